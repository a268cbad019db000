"""A prepared TFDS split as a random-access source that reads one record in microseconds.

TFDS's own `as_data_source` reads through `ArrayRecordReader.read(indices)`, which
costs a fixed tens of milliseconds a call on a file of millions of records, however few
records it reads, so reading shuffled records one at a time, as a grain pipeline does,
would take minutes per batch. `read(i, i + 1)`, a one-record range, costs microseconds.
This source uses that, and decodes each record as the dataset's own features do, so
record i is what `as_data_source(split)[i]` is. Records whose features are all text
(translation data, the local labelled-text files) are decoded by protobuf's parser alone,
an order of magnitude faster than the features' own decoding: with hundreds of records a
training batch, that is CPU the train step would otherwise share. `encode_text_example`
writes such records (the local parallel-text builder), likewise several times faster than
the features' serializer.
"""

import bisect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from array_record.python.array_record_module import ArrayRecordReader
from tensorflow_datasets.proto import tf_example_pb2  # TFDS's copy: no TensorFlow import.

from common.errors import UserInputError

# No read-ahead: shuffled records are far apart, and a buffer would be refilled at every read.
_READER_OPTIONS = "readahead_buffer_size:0"


class ArrayRecordSource(Sequence[dict[str, Any]]):
    """The records of one split's ArrayRecord shards, by global index: len() and [i].

    Readers open lazily, one per shard and process: pickling (for grain's worker
    processes) carries only the paths, lengths and features.
    """

    def __init__(self, paths: Sequence[str], lengths: Sequence[int], features: tfds.features.FeaturesDict):
        if len(paths) != len(lengths):
            raise ValueError(f"{len(paths)} shard files but {len(lengths)} shard lengths.")
        self._paths = [str(path) for path in paths]
        self._starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()  # Shard k holds [starts[k], starts[k+1]).
        self._features = features
        # Keys of a flat dict of Text features (each a bytes_list of one value), else None.
        self._text_keys = _text_feature_keys(features)
        self._readers: list[ArrayRecordReader | None] = [None] * len(self._paths)

    @classmethod
    def from_builder(cls, builder: tfds.core.DatasetBuilder, split: str) -> "ArrayRecordSource":
        """The prepared `split` of `builder` (file_format 'array_record')."""
        info = builder.info.splits[split]
        return cls(info.filepaths, info.shard_lengths, builder.info.features)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"Record {index} of a source of {len(self)}.")
        shard = bisect.bisect_right(self._starts, index) - 1
        position = index - self._starts[shard]
        try:
            serialized = self._reader(shard).read(position, position + 1)[0]
        except RuntimeError as e:  # Riegeli's checks: a chunk whose hash or framing is wrong.
            reason = next(iter(str(e).splitlines()), type(e).__name__)
            raise _damaged(self._paths[shard], f"record {position}: {reason}") from None
        if self._text_keys is None:
            return self._features.deserialize_example_np(serialized)
        return _decode_text_example(serialized, self._text_keys, index)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": [None] * len(self._paths)}

    def _reader(self, shard: int) -> ArrayRecordReader:
        """Shard `shard`'s reader, opened and checked at its first read.

        Raises:
            UserInputError: the shard is missing, unreadable or holds another number of records than
                the dataset's info lists (a truncated file opens as an empty one).
        """
        if self._readers[shard] is None:
            path, expected = self._paths[shard], self._starts[shard + 1] - self._starts[shard]
            if not os.path.exists(path):
                raise _damaged(path, "missing")
            reader = ArrayRecordReader(path, options=_READER_OPTIONS)
            if not reader.ok() or reader.num_records() != expected:
                found = f"{reader.num_records()} records" if reader.ok() else "unreadable"
                raise _damaged(path, f"{found}, where the dataset's info lists {expected}")
            self._readers[shard] = reader
        return self._readers[shard]


def _damaged(path: str, detail: str) -> UserInputError:
    """The error for a prepared shard that cannot be read: delete the prepared split's folder to prepare it again."""
    return UserInputError(
        f"The prepared records {path} are damaged ({detail}): delete {os.path.dirname(path)} and run again to "
        "prepare the dataset anew (a local dataset is prepared by the run; a TFDS dataset by name with `tfds build`)."
    )


def encode_text_example(example: Mapping[str, str]) -> bytes:
    """A serialized tf.train.Example of text features, {key: str}: what the features' `serialize_example` writes.

    Each value is stored as a bytes_list of its UTF-8 bytes. The bytes may differ from the
    features' serializer's (protobuf writes a map's entries in no fixed order); the parsed record
    is the same.
    """
    record = tf_example_pb2.Example()
    for key, text in example.items():
        record.features.feature[key].bytes_list.value.append(text.encode("utf-8"))
    return record.SerializeToString()


def _decode_text_example(serialized: bytes, keys: list[str], index: int) -> dict[str, bytes]:
    """{key: the bytes of its one value} of a serialized tf.train.Example of text features."""
    feature = tf_example_pb2.Example.FromString(serialized).features.feature
    example = {}
    for key in keys:
        values = feature[key].bytes_list.value if key in feature else ()
        if len(values) != 1:
            raise ValueError(f"Record {index} holds {len(values)} values of its text feature {key!r}, not one.")
        example[key] = values[0]
    return example


def _text_feature_keys(features: tfds.features.FeatureConnector) -> list[str] | None:
    """The keys of `features` if it is a flat dict of required plain Text features, else None.

    Such a feature is stored as a bytes_list of one value and decoded as those bytes (a Text with
    an encoder stores int64 ids instead).
    """
    if not isinstance(features, tfds.features.FeaturesDict):
        return None
    for feature in features.values():
        stored = feature.get_serialized_info()
        if not (
            type(feature) is tfds.features.Text
            and isinstance(stored, tfds.features.TensorInfo)
            and stored.np_dtype == np.object_
            and stored.shape == ()
            and not feature.get_tensor_info().optional
        ):
            return None
    return list(features.keys())
