"""What the project's TFDS builders of local text files share: each split written as one ArrayRecord file.

Parallel text (translation) and labelled text (classification) are both prepared here, a
record at a time in file order, and read back by random access (`record_source.py`) through
`datasets.records`; neither step needs TensorFlow.
"""

import hashlib
import os
from collections.abc import Iterable

import tensorflow_datasets as tfds
from array_record.python.array_record_module import ArrayRecordWriter

from input_pipeline.record_source import encode_text_example

# A record per chunk, so that a record is read alone. Uncompressed: a sentence pair compressed alone
# shrinks little (the files grow by about a fifth without zstd), while zstd takes several times as
# long to write a record and about twice as long to read one.
_WRITER_OPTIONS = "group_size:1,uncompressed"


def fingerprint(paths: Iterable[str]) -> str:
    """A short hash of the files' names, sizes and times: new data, new dataset."""
    digest = hashlib.sha256()
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]


class LocalTextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A builder of local text files whose features are all plain Text, prepared into one ArrayRecord file a split.

    Subclasses give `_info` and `_split_generators` ({split: (key, {feature: str}) examples}, in file order).
    """

    def __init__(self, *, config_name: str, description: str, **kwargs):
        config = tfds.core.BuilderConfig(name=config_name, description=description)
        super().__init__(config=config, file_format="array_record", **kwargs)

    def _download_and_prepare(self, dl_manager, download_config=None) -> None:
        """Writes each split into one ArrayRecord file, an example at a time, in the generator's order.

        Not TFDS's writer: it holds up to 1 GB of examples in memory, then reads a whole split back
        from disk to sort it by key, so its peak memory grows with the corpus; this one's does not.
        """
        del download_config
        split_infos = []
        for split, examples in self._split_generators(dl_manager).items():
            template = tfds.core.ShardedFileTemplate(
                data_dir=self.data_path, dataset_name=self.name, split=split, filetype_suffix="array_record"
            )
            path = template.sharded_filepath(shard_index=0, num_shards=1)
            writer = ArrayRecordWriter(os.fspath(path), _WRITER_OPTIONS)
            num_examples = num_bytes = 0
            try:
                for _, example in examples:
                    record = encode_text_example(example)  # The Text features' record, faster (record_source.py).
                    writer.write(record)
                    num_examples, num_bytes = num_examples + 1, num_bytes + len(record)
            finally:
                writer.close()
            split_infos.append(
                tfds.core.SplitInfo(
                    name=split, shard_lengths=[num_examples], num_bytes=num_bytes, filename_template=template
                )
            )
        self.info.set_splits(tfds.core.SplitDict(split_infos))
