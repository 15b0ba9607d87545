"""Megatron-core's rank order, reimplemented in pure Python (no torch: planning runs on login nodes).

`RankGenerator` and `generate_masked_orthogonal_rank_groups` follow
`megatron.core.parallel_state` (megatron-core 0.16.1) line for line, so the groups a plan prints are
the groups `initialize_model_parallel(order="tp-cp-ep-dp-pp")` builds. Indices here are a role's
local ranks 0..world-1; the compiler maps them onto the role's device slots.
"""
from __future__ import annotations

ORDER = "tp-cp-ep-dp-pp"
GROUP_KINDS = ("tp", "pp", "cp", "ep", "dp")


def _prefix_product(values: list[int], init: int = 1) -> list[int]:
    result = [init]
    for value in values:
        init *= value
        result.append(init)
    return result


def _inner_product(a: list[int], b: list[int]) -> int:
    return sum(x * y for x, y in zip(a, b))


def _decompose(index: int, shape: list[int]) -> list[int]:
    """The mixed-radix digits of `index` for `shape` (first dimension fastest)."""
    stride = _prefix_product(shape)
    digits = [(index // d) % s for s, d in zip(shape, stride)]
    assert _inner_product(digits, stride[:-1]) == index, (index, shape, digits)
    return digits


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: list[int],
                                           mask: list[bool]) -> list[list[int]]:
    """The groups of the dimensions where `mask` is True, one group per combination of the others.

    `parallel_size` lists the sizes in rank order (fastest-varying first); a rank is
    sum(index[i] * prod(parallel_size[:i])).
    """
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = _prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    groups = []
    for group_index in range(world_size // group_size):
        group_offset = _inner_product(_decompose(group_index, unmasked_shape), unmasked_stride)
        groups.append([_inner_product(_decompose(r, masked_shape), masked_stride) + group_offset
                       for r in range(group_size)])
    return groups


class RankGenerator:
    """Rank groups for a tp/ep/dp/pp/cp layout in a given order, as megatron-core's RankGenerator."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = ORDER,
                 rank_offset: int = 0) -> None:
        if ep != 1 and cp != 1:
            raise ValueError("ep and cp cannot both be > 1 in one RankGenerator (Megatron keeps cp in the "
                             "dense generator and ep in the expert generator)")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        order = order.lower()
        for name, size in self.name_to_size.items():
            if name not in order.split("-"):
                if size != 1:
                    raise ValueError(f"{name} size is {size} but the order {order!r} does not name it")
                order = f"{order}-{name}"
        self.order = order
        self.ordered_size = [self.name_to_size[token] for token in order.split("-")]

    def get_mask(self, order: str, token: str) -> list[bool]:
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for name in token.split("-"):
            mask[ordered.index(name)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups for `token`, e.g. "tp", "dp", "tp-pp" (a hyphen joins dimensions)."""
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size,
                                                        self.get_mask(self.order, token))
        if self.rank_offset:
            groups = [[rank + self.rank_offset for rank in group] for group in groups]
        return groups


def megatron_groups(tp: int, pp: int, cp: int, ep: int, dp: int, order: str = ORDER) -> dict[str, list[list[int]]]:
    """Local-rank groups for one role, keyed tp, pp, cp, ep, dp, as Megatron's initialize_model_parallel.

    tp, pp, cp and dp come from the dense ("decoder") generator with ep=1. ep comes from the expert
    generator: expert tensor parallel = tp, expert data parallel = world / (tp * ep * pp), cp folded
    into it (cp=1), the same order. With ep=1 (dense models) every ep group is a single rank.
    """
    world = tp * pp * cp * dp
    if (world % (tp * ep * pp)) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*ep*pp = {tp * ep * pp}")
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=order)
    return {"tp": dense.get_ranks("tp"), "pp": dense.get_ranks("pp"), "cp": dense.get_ranks("cp"),
            "ep": expert.get_ranks("ep"), "dp": dense.get_ranks("dp")}
