"""The attention page (training/reporting/attention_page.py) driven in Debian's headless chromium through Selenium.

For benchmarks/attention_page.py and tests/test_attention_page.py; it defines no flags, so tests import it.
Selenium (the test extra) is imported only when a browser is opened or driven.
"""

import os

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium, chromium-driver.


def open_chromium(chromium: str = CHROMIUM, driver: str = CHROMEDRIVER, width: int = 1400, height: int = 1000):
    """A headless Chromium driven by Selenium, its console kept for `console_errors`. Quit it when done."""
    from selenium import webdriver  # pylint: disable=import-outside-toplevel  (the test extra)
    from selenium.webdriver.chrome.service import Service  # pylint: disable=import-outside-toplevel

    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # Given, with the driver: Selenium looks for (and downloads) nothing.
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def console_errors(browser) -> list[str]:
    """The page's console errors since the last call (uncaught exceptions, rejected promises, console.error)."""
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def wait_until_drawn(browser, expected: str | None = None) -> None:
    """Waits for the page to draw `expected` ('<sentence>/<kind>/<layer>/<head>/<view>'), or anything."""
    from selenium.webdriver.support.ui import WebDriverWait  # pylint: disable=import-outside-toplevel

    def drawn(driver):
        ready = driver.find_element("tag name", "body").get_attribute("data-ready")
        return ready if ready and (expected is None or ready == expected) else False

    WebDriverWait(browser, 10).until(drawn, message=f"the page never drew {expected or 'anything'}")


def open_page(browser, path: str) -> None:
    browser.get("file://" + os.path.abspath(path))
    wait_until_drawn(browser)


def choose(browser, kind: str, layer: int, head: str, view: str, sentence: int = 0) -> None:
    """Picks a kind ('decoder/cross_attention'), layer, head ('2' or 'all') and view ('heatmap', 'lines')."""
    from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel

    browser.find_element("css selector", f'input[name="kind"][value="{kind}"]').click()
    Select(browser.find_element("id", "layer")).select_by_value(str(layer))
    Select(browser.find_element("id", "head")).select_by_value(head)
    browser.find_element("css selector", f'input[name="view"][value="{view}"]').click()
    wait_until_drawn(browser, f"{sentence}/{kind}/{layer}/{head}/{view}")


def click_piece(browser, seq: str, index: int) -> None:
    """Clicks piece `index` of 'source' or 'target' in the page's texts."""
    browser.find_element("css selector", f'#texts [data-seq="{seq}"][data-index="{index}"]').click()
