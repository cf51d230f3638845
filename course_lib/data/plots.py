"""Pictures of how megatron-core's ``GPTDataset`` turns documents into samples, and in which order.

Lab 11 shows :func:`plot_document_samples` twice: in its theory, before anything runs (``figures/``,
drawn by :func:`write_figures`, ``python -m course_lib figures``), and live on the split it builds.
matplotlib is imported when a picture is drawn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIGURE_NAME = "data_documents_samples_order.png"
TOY_SIZES = (10, 7, 16)          # Lab 11's three documents (tokens each), seq_length 8
TOY_SEQ_LENGTH = 8
_COLOURS = ("#8ecae6", "#ffb703", "#b5e48c", "#f4a3c0", "#cdb4db", "#a3c4bc", "#ffd6a5", "#bde0fe")


class ToyDocuments:
    """An indexed dataset in memory (``sequence_lengths``, ``get``): token ``t`` of document ``d`` is
    ``100 * d + t``, so a sample shows which documents and offsets it came from."""

    def __init__(self, sizes=TOY_SIZES):
        self.sequence_lengths = np.asarray(sizes, dtype=np.int32)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        return (100 * i + np.arange(n))[offset: n if length is None else offset + length]


def toy_dataset(seed: int = 1234):
    """Lab 11's example: :data:`TOY_SIZES` documents, one epoch, ``seq_length`` :data:`TOY_SEQ_LENGTH`."""
    from course_lib.data.gpt_dataset import MegatronGPTDataset

    return MegatronGPTDataset(ToyDocuments(), np.arange(len(TOY_SIZES), dtype=np.int32), None,
                              seq_length=TOY_SEQ_LENGTH, seed=seed, eod=-1)


def plot_document_samples(dataset, max_tokens: int | None = None, title: str | None = None):
    """Three rows over the token stream of ``dataset`` (a :class:`~course_lib.data.gpt_dataset.MegatronGPTDataset`):
    the documents in document-index order, the samples (``seq_length + 1`` tokens from every
    ``seq_length``-th token: neighbours overlap by one), and which draw ``i`` takes each sample
    (``shuffle_index[i]``). ``max_tokens`` crops a long split to its first tokens."""
    import matplotlib.pyplot as plt

    sizes = np.asarray(dataset.indexed.sequence_lengths)
    s = dataset.seq_length
    stream = int(sizes[np.asarray(dataset.document_index)].sum())
    end = stream if max_tokens is None else min(stream, max_tokens)
    fig, ax = plt.subplots(figsize=(10, 2.6))
    x = 0
    for d in np.asarray(dataset.document_index):
        if x >= end:
            break
        n = int(sizes[d])
        ax.barh(2, n, left=x, color=_COLOURS[int(d) % len(_COLOURS)], edgecolor="k")
        ax.text(x + min(n, end - x) / 2, 2, f"doc {d}", ha="center", va="center", fontsize=8, clip_on=True)
        x += n
    drawn = {int(j): i for i, j in enumerate(np.asarray(dataset.shuffle_index))}
    for j in range(len(dataset)):
        if j * s >= end:
            break
        ax.barh(1, s + 1, left=s * j, height=0.5, color="none", edgecolor="C3", lw=1.5)
        ax.text(s * j + (s + 1) / 2, 1, f"sample {j}", ha="center", va="center", fontsize=8, clip_on=True)
        ax.text(s * j + (s + 1) / 2, 0.35, f"drawn {drawn[j]}", ha="center", va="center", color="C0", fontsize=8,
                clip_on=True)
    ax.set_yticks([2, 1, 0.35], ["documents\n(shuffled)", "samples\n(s+1 tokens)", "order"])
    ax.set_xlabel("token position in the shuffled stream")
    ax.set_xlim(0, end + 1)
    ax.set_ylim(0, 2.6)
    ax.set_title(title or f"{stream} tokens, seq_length {s}: ({stream} - 1) // {s} = {len(dataset)} samples, "
                          f"neighbours share one token")
    fig.tight_layout()
    return fig


def write_figures(out_dir) -> list[Path]:
    """``figures/data_documents_samples_order.png``: Lab 11 §4's example before anything runs."""
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.safe_files import save_and_close_figure

    return [save_and_close_figure(plot_document_samples(toy_dataset()), Path(out_dir) / FIGURE_NAME)]
