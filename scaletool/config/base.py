"""The recipe schema's ground floor: section names, size limits and the base every section validates with.

:class:`_Section` refuses booleans where numbers belong (and numbers where booleans do) and integers past int64;
the limits bound every size far above any published model (see the comment below). Imported by the
sections (:mod:`scaletool.config.sections`, :class:`~scaletool.config.ModelConfig`) and re-exported by
:mod:`scaletool.config`.
"""
from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scaletool.kinds import attention as attention_kinds

SECTIONS = ("model", "train", "parallel", "data", "profile")
ATTENTION_NAMES = tuple(attention_kinds.ATTENTION_KINDS)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# data.source=text: 256 byte ids + <|endoftext|> (scaletool.train.data.ByteTokenizer; a test keeps them equal)
BYTE_VOCAB = 257

# Size limits. Each is far above any published model (widest d_model ~16k-25k, deepest ~1,000 layers,
# longest context ~10M tokens, most experts ~1M in PEER, ~2·10^12 weights) and low enough that no weight
# tensor's element count overflows int64 and that `count` builds the layers in seconds.
MAX_LAYERS = 4096
MAX_WIDTH = 2**20       # d_model, head dims, latent ranks, FFN widths, regression features
MAX_HEADS = 2**16
MAX_EXPERTS = 2**20
MAX_VOCAB = 2**32       # token ids are at most uint32
MAX_SEQ_LEN = 2**24     # the RoPE table holds max_seq_len rows
MAX_WEIGHTS = 10**15    # bound on the weights of one model (see weights_bound)
INT64 = 2**63

def _takes(annotation: Any, kind: type) -> bool:
    """Whether a field annotated ``annotation`` takes values of ``kind`` (bool, int, float) as such."""
    if annotation is Any or annotation is kind:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(type(a) is kind for a in args)
    return any(_takes(a, kind) for a in args)  # unions, Annotated, Optional


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        """Booleans are not numbers and numbers are not booleans: YAML reads yes/no/on/off as booleans,
        and pydantic would take ``n_layers: yes`` as 1 and ``enabled: 2`` as true."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or isinstance(value, type) or not isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, bool) and not _takes(field.annotation, bool):
            raise ValueError("a boolean is not a number or text here (YAML reads true/false, yes/no and on/off as "
                             "booleans)")
        if not isinstance(value, bool) and _takes(field.annotation, bool) and not (
                _takes(field.annotation, int) or _takes(field.annotation, float)):
            raise ValueError("expected true or false, not a number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Every integer fits int64 (torch's index type): a step count or seed of 10**30 fails here, not in torch."""
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
            raise ValueError("must fit a 64-bit integer")
        return value


def _derive(cfg: BaseModel, key: str, value: Any) -> None:
    """Set a derived field without marking it as given: ``model_dump(exclude_unset=True)`` stays what
    the user wrote, so re-validating it with one key changed derives the others afresh."""
    cfg.__dict__[key] = value


def _width(default: int | None, description: str = "", zero_ok: bool = False) -> Any:
    """A width or rank field: positive (or >= 0), at most MAX_WIDTH."""
    bound = {"ge": 0} if zero_ok else {"gt": 0}
    return Field(default, le=MAX_WIDTH, description=description, **bound)
