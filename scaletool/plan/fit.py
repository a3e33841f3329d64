"""Whether an estimated peak fits a card, with the allocator's margin kept free."""
from __future__ import annotations

#: the share of the card kept free for what the estimate leaves out (the caching allocator's
#: fragmentation, the CUDA context, NCCL's buffers): an 80 GB H100 reports 79.2 GiB, and a run
#: estimated at 74.8 GiB ran out of memory there
ALLOCATOR_MARGIN = 0.07


def fits(total_bytes: float, card_bytes: float) -> tuple[bool, int]:
    """(fits, margin): the margin is what is left of the usable memory (negative: how much is missing)."""
    margin = int(card_bytes * (1 - ALLOCATOR_MARGIN) - total_bytes)
    return margin >= 0, margin
