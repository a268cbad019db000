"""The two LibreOffice help packages: reading a .deb (pure Python, dpkg-deb as a fallback) and apt-get download."""

from __future__ import annotations

import glob
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass

EN_PACKAGE = "libreoffice-help-en-us"
DE_PACKAGE = "libreoffice-help-de"
HELP_ROOT = "usr/share/libreoffice/help"
EN_LANG = "en-US"
DE_LANG = "de"


class BuildError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def read_ar_members(data: bytes) -> dict[str, bytes]:
    """Return ``{name: content}`` of a Unix ``ar`` archive (the .deb container)."""
    if not data.startswith(b"!<arch>\n"):
        raise BuildError("not a .deb (ar) archive")
    members: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = pos + 60
        members[name] = data[start : start + size]
        pos = start + size + (size % 2)  # members are 2-byte aligned
    return members


def open_deb_tar(deb_path: str, prefix: str) -> tarfile.TarFile:
    """Open the ``control.tar.*`` or ``data.tar.*`` member of a .deb as a TarFile."""
    with open(deb_path, "rb") as f:
        members = read_ar_members(f.read())
    for name, blob in sorted(members.items()):
        if name.startswith(prefix + ".tar"):
            try:
                return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")
            except tarfile.ReadError:
                break  # e.g. zstd: let dpkg-deb decompress it
    if shutil.which("dpkg-deb") is None:
        raise BuildError(f"cannot read {prefix}.tar in {deb_path} (and dpkg-deb is not installed)")
    flag = "--fsys-tarfile" if prefix == "data" else "--ctrl-tarfile"
    out = subprocess.run(["dpkg-deb", flag, deb_path], check=True, capture_output=True).stdout
    return tarfile.open(fileobj=io.BytesIO(out), mode="r:")


def parse_control(text: str) -> dict[str, str]:
    """Parse a Debian ``control`` file (single stanza) into ``{field: value}``."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip()
            fields[key] = value.strip()
    return fields


@dataclass
class DebContents:
    """What we need from one help package."""

    package: str
    version: str
    sha256: str
    filename: str
    pages: dict[str, str]  # page path relative to help/<lang>/ -> HTML text
    copyright: str


def load_deb(deb_path: str, lang: str) -> DebContents:
    """Read package metadata, the ``copyright`` file and all HTML pages of ``lang``."""
    if not os.path.isfile(deb_path):
        raise BuildError(f"missing .deb file: {deb_path}")
    with open(deb_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with open_deb_tar(deb_path, "control") as tar:
        control = {}
        for m in tar.getmembers():
            if m.isfile() and m.name.lstrip("./") == "control":
                control = parse_control(tar.extractfile(m).read().decode("utf-8"))
    page_prefix = f"{HELP_ROOT}/{lang}/"
    pages: dict[str, str] = {}
    copyright_text = ""
    with open_deb_tar(deb_path, "data") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            name = m.name[2:] if m.name.startswith("./") else m.name
            if name.startswith(page_prefix) and name.endswith(".html"):
                pages[name[len(page_prefix) :]] = tar.extractfile(m).read().decode("utf-8")
            elif re.fullmatch(r"usr/share/doc/[^/]+/copyright", name):
                copyright_text = tar.extractfile(m).read().decode("utf-8")
    if not pages:
        raise BuildError(f"no help pages for language {lang!r} in {deb_path}")
    return DebContents(
        package=control.get("Package", "?"),
        version=control.get("Version", "?"),
        sha256=sha,
        filename=os.path.basename(deb_path),
        pages=pages,
        copyright=copyright_text,
    )


def apt_download(dest: str) -> tuple[str, str]:
    """Download the two packages with ``apt-get download`` into ``dest``."""
    if shutil.which("apt-get") is None:
        raise BuildError("--en-deb/--de-deb not given and apt-get is not available")
    cmd = ["apt-get", "download", EN_PACKAGE, DE_PACKAGE]
    res = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise BuildError(f"apt-get download failed ({msg}); try 'apt-get update' first")
    found = []
    for pkg in (EN_PACKAGE, DE_PACKAGE):
        matches = sorted(glob.glob(os.path.join(dest, f"{pkg}_*.deb")))
        if not matches:
            raise BuildError(f"apt-get download did not produce {pkg}_*.deb")
        found.append(matches[-1])
    return found[0], found[1]
