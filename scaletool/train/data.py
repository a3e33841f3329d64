"""Training data: every sample is a pure function of (seed, step, global sample index).

Each rank builds (or reads from its memmap) only its own samples of the global batch, so the same seed
and batch give the same data on 1 or N ranks and a resumed run continues exactly, with no loader state.

Sources (``data.source``): ``synthetic`` (lm: random tokens with a learnable bigram structure, so the
loss falls from ln(V) towards ln(V/2)/2), ``text`` (UTF-8 files through :class:`ByteTokenizer`),
``tokens`` (pre-tokenised uint16/uint32, memory-mapped), ``synthetic`` (regression: N(0, 1) series
with a learnable tanh target) and ``csv`` (regression: z-scored columns, the first one's next
``horizon`` values as targets).
"""
from __future__ import annotations

import math
import stat
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from scaletool.config import Recipe, RecipeError


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """A CPU generator unique to (seed, step, index); CPU so that data match across devices."""
    mixed = (seed * 0x9E3779B1 + step * 0x85EBCA77 + index * 0xC2B2AE3D) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the bytes of UTF-8 text, then the special tokens."""

    SPECIALS = ("<|endoftext|>",)

    def __init__(self):
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.eos_id = self.special_ids["<|endoftext|>"]

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Specials are dropped; invalid UTF-8 (a window cut inside a character) is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class Source(ABC):
    """Per-rank batches. ``batch(step, micro)`` -> (inputs, targets) CPU tensors for this rank."""

    def __init__(self, recipe: Recipe, rank: int, world_size: int):
        self.seed = recipe.train.seed
        self.mb = recipe.train.micro_batch_size
        self.seq_len = recipe.seq_len
        self.rank, self.world_size = rank, world_size

    def indices(self, micro: int) -> range:
        first = (micro * self.world_size + self.rank) * self.mb
        return range(first, first + self.mb)

    @abstractmethod
    def sample(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global sample ``index`` of ``step``: (input, target) tensors without a batch dim."""

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.sample(step, g) for g in self.indices(micro)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class SyntheticTokens(Source):
    def __init__(self, recipe: Recipe, rank: int, world_size: int):
        super().__init__(recipe, rank, world_size)
        V = recipe.model.vocab_size
        if V < 4:
            raise RecipeError(f"model.vocab_size: {V} is too small for synthetic tokens (need >= 4)")
        self.half = V // 2
        g = torch.Generator().manual_seed(self.seed)
        self.successor = self.half + torch.randperm(V - self.half, generator=g)[: self.half]

    def sample(self, step, index):
        n = (self.seq_len + 2) // 2
        first = torch.randint(0, self.half, (n,), generator=sample_generator(self.seed, step, index))
        seq = torch.stack([first, self.successor[first]], dim=1).reshape(-1)[: self.seq_len + 1]
        return seq[:-1], seq[1:]


class TokenWindows(Source):
    """Windows of seq_len + 1 tokens at seeded offsets in a flat token array (memmap or in memory)."""

    def __init__(self, recipe: Recipe, rank: int, world_size: int, tokens: np.ndarray, what: str):
        super().__init__(recipe, rank, world_size)
        self.tokens, self.vocab = tokens, recipe.model.vocab_size
        if len(tokens) < self.seq_len + 1:
            raise RecipeError(f"data.path: {what} holds {len(tokens)} tokens, fewer than "
                              f"train.seq_len + 1 = {self.seq_len + 1}")
        self.what = what

    def sample(self, step, index):
        hi = len(self.tokens) - self.seq_len
        start = int(torch.randint(0, hi, (1,), generator=sample_generator(self.seed, step, index)))
        w = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        top = int(w.max())
        if top >= self.vocab:
            raise RecipeError(f"data.path: {self.what} has token id {top} at offset >= {start}, "
                              f"outside model.vocab_size={self.vocab}")
        return w[:-1], w[1:]


def _text_tokens(path: Path, tok: ByteTokenizer) -> np.ndarray:
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise RecipeError(f"data.path: {path} is a directory without *.txt files")
    parts = []
    for f in files:
        parts.append(np.fromfile(f, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([tok.eos_id], dtype=np.uint16))
    return np.concatenate(parts)


class SyntheticSeries(Source):
    def __init__(self, recipe: Recipe, rank: int, world_size: int):
        super().__init__(recipe, rank, world_size)
        m = recipe.model
        self.n, self.F, self.H = recipe.data.num_samples, m.n_features, m.horizon
        g = torch.Generator().manual_seed(self.seed)
        self.W = torch.randn(self.F, self.H, generator=g) / math.sqrt(self.F)

    def sample(self, step, index):
        # which series: seeded by (step, index); the series itself: seeded by its id alone
        k = int(torch.randint(0, self.n, (1,), generator=sample_generator(self.seed, step, index)))
        g = sample_generator(self.seed, -1, k)
        x = torch.randn(self.seq_len, self.F, generator=g)  # (T, F)
        y = torch.tanh(x[-1] @ self.W) + 0.05 * torch.randn(self.H, generator=g)  # (H,)
        return x, y


class CsvSeries(Source):
    def __init__(self, recipe: Recipe, rank: int, world_size: int, path: Path):
        super().__init__(recipe, rank, world_size)
        m = recipe.model
        self.H = m.horizon
        try:
            data = np.genfromtxt(path, delimiter=",", dtype=np.float32)
        except ValueError as e:
            raise RecipeError(f"data.path: {path}: not a numeric CSV ({e})") from None
        if data.ndim == 1:
            data = data[:, None]
        if len(data) and np.isnan(data[0]).all():  # a header row
            data = data[1:]
        if data.shape[1] != m.n_features:
            raise RecipeError(f"data.path: {path} has {data.shape[1]} columns, model.n_features is {m.n_features}")
        if np.isnan(data).any():
            row = int(np.argwhere(np.isnan(data))[0][0])
            raise RecipeError(f"data.path: {path}: non-numeric or empty value in data row {row + 1}")
        if len(data) < self.seq_len + self.H:
            raise RecipeError(f"data.path: {path} has {len(data)} rows, fewer than train.seq_len + "
                              f"model.horizon = {self.seq_len + self.H}")
        std = data.std(0)
        self.data = torch.from_numpy((data - data.mean(0)) / np.where(std > 0, std, 1))
        self.windows = len(data) - self.seq_len - self.H + 1

    def sample(self, step, index):
        i = int(torch.randint(0, self.windows, (1,), generator=sample_generator(self.seed, step, index)))
        x = self.data[i:i + self.seq_len]
        y = self.data[i + self.seq_len:i + self.seq_len + self.H, 0]
        return x, y


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise RecipeError(f"data.path: {p}: no such file or directory")
    return p


def make_source(recipe: Recipe, rank: int, world_size: int) -> Source:
    """The data source the recipe selects, for this rank; problems raise one-line RecipeErrors."""
    d, m = recipe.data, recipe.model
    if m.task == "regression":
        if d.source == "csv":
            return CsvSeries(recipe, rank, world_size, _existing(d.path))
        return SyntheticSeries(recipe, rank, world_size)
    if d.source == "synthetic":
        return SyntheticTokens(recipe, rank, world_size)
    p = _existing(d.path)
    if d.source == "text":
        tok = ByteTokenizer()
        if m.vocab_size < tok.vocab_size:
            raise RecipeError(f"model.vocab_size: {m.vocab_size} is too small for the byte-level tokenizer "
                              f"of data.source=text (needs >= {tok.vocab_size}: 256 bytes + specials)")
        return TokenWindows(recipe, rank, world_size, _text_tokens(p, tok), str(p))
    return TokenWindows(recipe, rank, world_size, token_file(p, d.token_dtype), str(p))


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def token_file(path: Path, dtype: str) -> np.memmap:
    """``path`` memory-mapped as a flat array of ``dtype`` token ids. Anything else (a directory, a
    device such as /dev/zero, a FIFO, an empty file, a size that is no whole number of ids, a file that
    cannot be read) is one RecipeError naming what is wrong, checked before the file is opened."""
    try:
        st = path.stat()
    except OSError as e:
        raise RecipeError(f"data.path: {path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecipeError(f"data.path: {path} is a directory; data.source=tokens reads one flat file of token ids "
                          "(data.source=text reads a directory of *.txt)")
    kind = next((what for test, what in _NOT_REGULAR if test(st.st_mode)), None)
    if kind is not None:
        raise RecipeError(f"data.path: {path} is {kind}, not a regular file; data.source=tokens memory-maps a flat "
                          "file of token ids")
    item = np.dtype(dtype).itemsize
    if st.st_size == 0:
        raise RecipeError(f"data.path: {path} is empty; data.source=tokens needs a flat file of {dtype} token ids")
    if st.st_size % item:
        raise RecipeError(f"data.path: {path} holds {st.st_size} bytes, not a whole number of {item}-byte {dtype} "
                          "token ids; is data.token_dtype right?")
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise RecipeError(f"data.path: {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
