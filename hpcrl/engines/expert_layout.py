"""A mixture-of-experts layer's weights in transformers' fused layout and in the hub's per-expert one.

transformers 5 keeps a layer's experts stacked in two tensors, `mlp.experts.gate_up_proj` [E, 2I, H]
(each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], and converts a
hub checkpoint, which stores one tensor per expert and projection, as it loads it. vLLM (and
transformers 4) load only the hub layout: Qwen-MoE's `mlp.experts.E.{gate,up,down}_proj.weight`,
Mixtral's `block_sparse_moe.experts.E.{w1,w3,w2}.weight` and its router `block_sparse_moe.gate`.
So what hpcrl writes (the random init, exports) and what it sends vLLM is in the hub layout
(`hub_tensors`), and model_files.ModelFiles reads either (`HUB_PARTS`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FUSED_EXPERTS = re.compile(r"(.*\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(.*\.layers\.\d+)\.mlp\.gate\.weight")
# hub module name -> fused tensor -> the per-expert projections it stacks, in row order
HUB_PARTS = {"mlp": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
             "block_sparse_moe": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}}


def hub_module(model_type: str) -> str:
    """The module name a hub checkpoint of `model_type` keeps its experts under."""
    return "block_sparse_moe" if model_type == "mixtral" else "mlp"


def hub_tensors(named: Iterable[tuple[str, torch.Tensor]], model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (transformers' names) with each fused expert tensor cut into the hub's per-expert
    tensors, and Mixtral's router renamed; every other tensor as it comes."""
    module = hub_module(model_type)
    for name, tensor in named:
        fused = FUSED_EXPERTS.fullmatch(name)
        router = _ROUTER.fullmatch(name) if module != "mlp" else None
        if fused is not None:
            layer, kind = fused.groups()
            parts = HUB_PARTS[module][kind]
            for expert, weights in enumerate(tensor):
                for part, piece in zip(parts, weights.chunk(len(parts), dim=0)):
                    yield f"{layer}.{module}.experts.{expert}.{part}.weight", piece.contiguous()
        elif router is not None:
            yield f"{router.group(1)}.{module}.gate.weight", tensor
        else:
            yield name, tensor
