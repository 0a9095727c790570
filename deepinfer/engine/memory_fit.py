"""Does a model fit the devices it is given, and if not, which parallel layouts would it fit?

Pure arithmetic on byte counts (no device calls: the caller measures free memory and the model's
bytes, the latter from the model built on the meta device, before any weight is read).

The layout model: attention data parallelism with expert parallelism over N devices. Every rank
holds a full copy of everything that is not a routed expert (embeddings, attention, shared experts,
routers, the head, draft layers' dense parts) and 1/N of the routed experts (the expert counts of the
released models, 256 and 384, are multiples of every N listed), plus its own cache and workspace:

    per device = non-expert weights + routed-expert weights / N + reserve
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
# expert-parallel sizes offered when a model does not fit one device
EP_SIZES = (2, 4, 8, 16, 64)
# activations, CUDA-graph pools and allocator slack beyond the cache, per device: an assumption (not
# measured), large enough for a 8192-token prefill chunk of the released widths
WORKSPACE_BYTES = 2 * GiB


@dataclass(frozen=True)
class WeightBytes:
    """Bytes a model holds on its compute device, split by how expert parallelism divides them."""

    experts: int          # routed experts (weights and scales); split across expert-parallel ranks
    other: int            # everything else; every rank holds a copy
    packed_fp4: int = 0   # of `experts`: FP4 codes packed two per byte

    def __post_init__(self):
        for name in ("experts", "other", "packed_fp4"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"WeightBytes.{name}: must be a non-negative integer, got {v!r}")
        if self.packed_fp4 > self.experts:
            raise ValueError(f"WeightBytes.packed_fp4: {self.packed_fp4} bytes exceed the experts' {self.experts}")

    @property
    def total(self) -> int:
        return self.experts + self.other

    def serving(self, repack_fp4: bool) -> "WeightBytes":
        """The bytes held while serving (an upper bound). `repack_fp4`: packed FP4 experts are rewritten
        as FP8 codes (one byte per weight, twice the packed bytes), as LLM does where they fit
        (repack_fits); where their (1, 32) scales fold exactly into (1, 128) (Experts.fold_scales) the
        scales then take a quarter of their bytes, which this does not count."""
        if not repack_fp4:
            return self
        return WeightBytes(self.experts + self.packed_fp4, self.other, 0)


def per_device_bytes(weights: WeightBytes, ep_size: int, reserve: int) -> int:
    """Bytes one device needs with the routed experts split over `ep_size` ranks (rounded up)."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive integer, got {ep_size!r}")
    return weights.other + -(-weights.experts // ep_size) + reserve


def fitting_ep_sizes(weights: WeightBytes, available: int, reserve: int,
                     sizes: tuple[int, ...] = EP_SIZES) -> list[int]:
    """The expert-parallel sizes (of `sizes`) at which every device's share fits in `available` bytes."""
    return [n for n in sizes if per_device_bytes(weights, n, reserve) <= available]


def repack_fits(weights: WeightBytes, available: int, reserve: int, ep_size: int = 1) -> bool:
    """Whether FP4 experts rewritten as FP8 codes (faster GPU kernels, twice the codes' bytes) still fit
    one device beside the reserve, the routed experts split over `ep_size` ranks. False when there are
    no packed FP4 experts."""
    return weights.packed_fp4 > 0 and per_device_bytes(weights.serving(True), ep_size, reserve) <= available


def check_fit(weights: WeightBytes, available: int, reserve: int, where: str, ways: int = 1,
              layout: str | None = None) -> None:
    """Raises ValueError with needed vs available bytes per device, and the layouts that would fit,
    when the model and its reserve do not fit one device's `available` bytes with the routed experts
    split `ways` ways (`layout` names the parallel sizes that split them)."""
    need = per_device_bytes(weights, ways, reserve)
    if need <= available:
        return
    where = where if layout is None else f"{where} as {layout}"
    split = "" if ways == 1 else f" / {ways}"
    fits = fitting_ep_sizes(weights, available, reserve)
    if fits:
        layouts = ", ".join(f"{n} GPUs ({format_bytes(per_device_bytes(weights, n, reserve))} each)" for n in fits)
        hint = (f"attention DP + expert parallelism would fit on {layouts} "
                f"(data_parallel_size=N, enable_expert_parallel=True)")
    else:
        hint = (f"even {EP_SIZES[-1]}-way expert parallelism leaves {format_bytes(weights.other)} of non-expert "
                f"weights per GPU, which do not fit")
    raise ValueError(
        f"the model does not fit {where}: it needs {format_bytes(need)} per GPU ({format_bytes(weights.other)} non-expert weights "
        f"+ {format_bytes(weights.experts)}{split} routed experts + {format_bytes(reserve)} cache and workspace reserve) and "
        f"{format_bytes(available)} is available; {hint}")


def requests_at_length(num_slots: int, free_blocks: dict[int, int], blocks_per_request: dict[int, int]) -> int:
    """How many requests of one length the cache holds at once: slots, and each ratio's blocks."""
    n = num_slots
    for m, need in blocks_per_request.items():
        if need:
            n = min(n, free_blocks.get(m, 0) // need)
    return max(0, n)


def format_bytes(n: int) -> str:
    """GiB with two decimals from 1 GiB up, MiB with one below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"
