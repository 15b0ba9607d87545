"""Engine classes by the name a job gives them (`roles.<role>.engine`), imported only when asked for.

The GPU engines live behind pip extras; asking for one whose extra is not installed fails at
once with the command that installs it, instead of an ImportError deep inside a worker.
"""
from __future__ import annotations

import importlib
import importlib.util

# name -> (module, class, (extra, the module that extra provides) or None)
_TRAINING = {
    "torch": ("hpcrl.engines.torch_trainer", "TorchTrainer", None),
    "megatron": ("hpcrl.engines.megatron.engine", "MegatronTrainer", ("megatron", "megatron.core")),
    "deepspeed": ("hpcrl.engines.deepspeed_engine", "DeepSpeedTrainer", ("deepspeed", "deepspeed")),
}
_GENERATION = {
    "native": ("hpcrl.engines.native_sampler", "NativeSampler", None),
    "vllm": ("hpcrl.engines.vllm_engine", "VLLMEngine", ("vllm", "vllm")),
}


class EngineNotAvailable(ImportError):
    """The job names an engine this installation cannot run."""


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (its parent packages excepted)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _lookup(kind: str, table: dict, name: str) -> type:
    if name not in table:
        raise EngineNotAvailable(f"unknown {kind} engine {name!r} (known: {', '.join(sorted(table))})")
    module, cls, extra = table[name]
    if extra is not None and not _installed(extra[1]):
        raise EngineNotAvailable(f"engine {name!r} needs `pip install hpcrl[{extra[0]}]` "
                                 f"({extra[1]} is not installed)")
    return getattr(importlib.import_module(module), cls)


def training_engine(name: str) -> type:
    """The TrainingEngine class for "torch", "megatron" or "deepspeed"."""
    return _lookup("training", _TRAINING, name)


def generation_engine(name: str) -> type:
    """The GenerationEngine class for "native" or "vllm"."""
    return _lookup("generation", _GENERATION, name)
