"""``torch.distributed.checkpoint`` (DCP) for pieces of global tensors at any offsets.

A *piece* is ``(local tensor, key, global shape, global offsets)``: one rank's part of the tensor ``key``
of the whole model -- megatron-core's ``ShardedTensor`` (``megatron/core/dist_checkpointing/mapping.py``)
in four fields, which its ``torch_dist`` strategy hands to DCP the same way. A TP shard, an EP rank's
experts, an expert-TP slice of them, one decoder layer of a tensor stacked over the layers: each is a box
in the global tensor, whatever the layout that cut it. A rank may hold several pieces of one key (a
pipeline stage's layers); a local tensor with fewer dims than the global shape is one slice of the
leading axes (megatron-core's ``prepend_axis_num``).

* :class:`PieceSavePlanner` writes each piece as a chunk at its offsets (DCP's global plan refuses
  chunks that overlap, leave holes or stick out, and writes equal chunks of replicas once);
* :class:`PieceLoadPlanner` fills each piece with its overlap with every saved chunk
  (``create_read_items_for_chunk_list``: the resharding reads), once :func:`piece_problem` found the
  key and its global shape in the checkpoint;
* :class:`SafeFileSystemReader` is DCP's reader whose ``.metadata`` is read without running it
  (:func:`course_lib.training.safe_load.read_dcp_metadata`);
* :class:`RecordingReader` keeps what a rank read: ``(key, file, global start, lengths)``;
  :func:`written_chunks` what the files hold (from ``.metadata``).

Every other entry of the state (a replicated tensor, a ``BytesIO``) takes DCP's default path.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from course_lib.rules import UsageError

from course_lib.training.safe_load import read_dcp_metadata

__all__ = ["SafeFileSystemReader", "PieceSavePlanner", "PieceLoadPlanner", "RecordingReader", "piece_problem", "written_chunks", "save_pieces",
           "load_pieces"]


def _chunk(local: torch.Tensor, shape) -> torch.Tensor:
    """``local`` with the global tensor's number of dims (the prepended axes of size 1), sharing its memory."""
    return local if local.dim() == len(shape) else local.view(*[1] * (len(shape) - local.dim()), *local.shape)


def _write_item(key: str, local: torch.Tensor, shape, offsets) -> WriteItem:
    at = torch.Size(offsets)
    return WriteItem(index=MetadataIndex(key, at), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(at, local.shape),
                                                 properties=TensorProperties.create_from_tensor(local),
                                                 size=torch.Size(shape)))


def piece_problem(metadata, key: str, shape) -> str | None:
    """Why the checkpoint whose DCP ``metadata`` this is cannot fill a piece of ``key`` (global ``shape``),
    as what it holds (``"no tensor K"``, ``"K of global shape [4, 8], not [4, 16]"``); None when it can."""
    saved = metadata.state_dict_metadata.get(key)
    if saved is None or not hasattr(saved, "chunks"):
        return f"no tensor {key}"
    if tuple(saved.size) != tuple(shape):
        return f"{key} of global shape {list(saved.size)}, not {list(shape)}"
    return None


class _Pieces:
    """A planner that also handles ``pieces``. The state is flat: left unflattened, a ``BytesIO`` read
    lands in the caller's dict (DCP copies it back), and every key keeps its name."""

    def __init__(self, pieces: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [(key, _chunk(local.detach(), shape), shape, offsets)
                       for local, key, shape, offsets in pieces.values()]
        self.by_index = {(key, tuple(offsets)): local for key, local, _, offsets in self.pieces}

    def _local(self, index: MetadataIndex):
        return self.by_index.get((index.fqn, None if index.offset is None else tuple(index.offset)))


class PieceSavePlanner(_Pieces, DefaultSavePlanner):
    """DCP's default save plan for the state, plus one chunk per piece at the offsets given."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=plan.items + [_write_item(*piece) for piece in self.pieces])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        local = self._local(index)
        return super().lookup_object(index) if local is None else local.contiguous()


class PieceLoadPlanner(_Pieces, DefaultLoadPlanner):
    """DCP's default load plan for the state, plus the reads that fill each piece from the saved chunks."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, local, shape, offsets in self.pieces:
            problem = piece_problem(self.metadata, key, shape)
            if problem:
                raise UsageError(f"the checkpoint holds {problem}")
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                      [ChunkStorageMetadata(torch.Size(offsets), local.shape)])
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex):
        local = self._local(index)
        return super().lookup_tensor(index) if local is None else local


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` builds only DCP's own metadata classes."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RecordingReader(SafeFileSystemReader):
    """A ``FileSystemReader`` that keeps what this rank read in ``reads``: ``(key, file, global start, lengths)``
    of every read item."""

    def __init__(self, path):
        super().__init__(path)
        self.reads: list[tuple] = []

    def read_data(self, plan, planner):
        for item in plan.items:
            start = tuple(a + b for a, b in zip(item.storage_index.offset or (), item.storage_offsets))
            self.reads.append((item.dest_index.fqn, self.storage_data[item.storage_index].relative_path, start,
                               tuple(item.lengths)))
        return super().read_data(plan, planner)


def written_chunks(metadata) -> dict[str, list[tuple]]:
    """What a checkpoint's files hold, from its DCP ``metadata``: ``{key: [(file, global offsets, sizes)]}``
    of every tensor, each chunk once, sorted (objects -- RNG states, ``_extra_state`` -- are left out)."""
    owner = {(i.fqn, tuple(i.offset)): s.relative_path
             for i, s in metadata.storage_data.items() if i.offset is not None}
    return {key: sorted((owner[(key, tuple(c.offsets))], tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            for key, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}


def save_pieces(state: dict, pieces: dict, path) -> None:
    """Save ``state`` (DCP's default handling: ``BytesIO``, objects) and ``pieces`` (``{name: (local, key,
    global shape, offsets)}``, keys not in ``state``) into the folder ``path``; collective."""
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), planner=PieceSavePlanner(pieces))


def load_pieces(state: dict, pieces: dict, path, reader: SafeFileSystemReader | None = None) -> None:
    """Fill ``state`` in place (a ``BytesIO`` entry is replaced by the one saved) and each piece's local
    tensor from the checkpoint in ``path``; collective. ``reader``: e.g. a :class:`RecordingReader`."""
    dcp.load(state, storage_reader=reader or SafeFileSystemReader(str(path)), planner=PieceLoadPlanner(pieces))
