"""The algorithm presets: `algorithm.name` picks the settings its paper uses; any field stays overridable.

A preset fills only the keys the job leaves out, before validation, so the schema then sees one
complete section and a job's explicit value always wins. Options that do not apply to the chosen
estimator or loss are refused here, by key, instead of being silently ignored. Pure Python: the
plan and the launcher resolve presets on a login node.
"""
from __future__ import annotations

from typing import Any

# name -> (the settings its paper uses, the paper). KL coefficients are those of verl's recipes;
# a preset's KL applies only when the job places a `reference` role (see `resolve_kl`).
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "ppo": ({"advantage": "gae", "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2,
             "loss_agg": "token-mean", "kl_in_reward": {"coef": 0.001, "estimator": "k1"}},
            "Schulman et al. 2017 (PPO), Ouyang et al. 2022 (KL in the reward)"),
    "grpo": ({"advantage": "grpo", "normalize_std": True, "policy_loss": "ppo_clip", "clip_low": 0.2,
              "clip_high": 0.2, "loss_agg": "seq-mean-token-mean", "kl_loss": {"coef": 0.001, "estimator": "k3"}},
             "Shao et al. 2024 (DeepSeekMath)"),
    "dr_grpo": ({"advantage": "grpo", "normalize_std": False, "policy_loss": "ppo_clip", "clip_low": 0.2,
                 "clip_high": 0.2, "loss_agg": "seq-mean-token-sum-norm"},
                "Liu et al. 2025 (Understanding R1-Zero-like training)"),
    "dapo": ({"advantage": "grpo", "normalize_std": True, "policy_loss": "ppo_clip", "clip_low": 0.2,
              "clip_high": 0.28, "loss_agg": "token-mean", "dynamic_sampling": True, "overlong_shaping": True},
             "Yu et al. 2025 (DAPO)"),
    "rloo": ({"advantage": "rloo", "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2,
              "loss_agg": "token-mean", "kl_in_reward": {"coef": 0.001, "estimator": "k1"}},
             "Ahmadian et al. 2024 (Back to basics: REINFORCE-style optimisation)"),
    "reinforce_pp": ({"advantage": "reinforce_pp", "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2,
                      "loss_agg": "token-mean", "kl_in_reward": {"coef": 0.001, "estimator": "k1"}},
                     "Hu 2025 (REINFORCE++)"),
    "gigpo": ({"advantage": "gigpo", "normalize_std": True, "gamma": 0.95, "step_advantage_weight": 1.0,
               "policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "loss_agg": "seq-mean-token-mean",
               "kl_loss": {"coef": 0.001, "estimator": "k3"}},
              "Feng et al. 2025 (GiGPO: group-in-group policy optimization for LLM agents)"),
    "gspo": ({"advantage": "grpo", "normalize_std": True, "policy_loss": "gspo", "clip_low": 3e-4,
              "clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"},
             "Zheng et al. 2025 (GSPO)"),
    "cispo": ({"advantage": "grpo", "normalize_std": True, "policy_loss": "cispo", "clip_low": 1.0,
               "clip_high": 0.28, "loss_agg": "token-mean"},
              "MiniMax 2025 (MiniMax-M1: CISPO)"),
}

# option -> (the setting it belongs to, the values of that setting it applies to)
_APPLIES_TO = {
    "normalize_std": ("advantage", ("grpo", "gigpo")),
    "dual_clip_c": ("policy_loss", ("ppo_clip",)),
    "gamma": ("advantage", ("gae", "reinforce_pp", "gigpo")),
    "step_advantage_weight": ("advantage", ("gigpo",)),
    "lam": ("advantage", ("gae",)),
    "value_clip": ("advantage", ("gae",)),
    "critic_warmup_steps": ("advantage", ("gae",)),
}


# keys of earlier versions -> what replaced them
_RENAMED = {"kl_coef": "the KL now goes in one of two places: algorithm.kl_loss.coef (a loss term, GRPO's form) "
                       "or algorithm.kl_in_reward.coef (a penalty in the reward, PPO's and REINFORCE++'s)",
            "kl_estimator": "use algorithm.kl_loss.estimator or algorithm.kl_in_reward.estimator"}


def apply_preset(raw: Any) -> Any:
    """The `algorithm` section with the preset's settings where the job gave none (an unknown name
    is left to the schema to report); refuses options that do not apply to the resolved settings."""
    if not isinstance(raw, dict):
        return raw
    renamed = [f"{key}: {hint}" for key, hint in _RENAMED.items() if key in raw]
    if renamed:
        raise ValueError("; ".join(renamed))
    name = raw.get("name", "grpo")
    if name not in PRESETS:
        return raw
    settings = PRESETS[name][0]
    resolved = {**raw}
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            resolved[key] = {**value, **raw[key]}
        elif key not in raw:
            resolved[key] = value
    for option, (setting, allowed) in _APPLIES_TO.items():
        chosen = resolved.get(setting)
        if option in raw and raw[option] is not None and chosen not in allowed:
            raise ValueError(f"{option} applies to {setting} {' or '.join(allowed)}, not {chosen!r} "
                             f"(algorithm.name {name!r}); remove it, or set {setting}")
    return resolved


def resolve_kl(raw: Any, has_reference: bool) -> Any:
    """A preset's KL needs the reference policy: without a `reference` role the KL terms the job did
    not set itself are off (the job's own coefficients are checked against the roles later)."""
    if has_reference or not isinstance(raw, dict):
        return raw
    resolved = {**raw}
    for key in ("kl_loss", "kl_in_reward"):
        given = raw.get(key) if isinstance(raw.get(key), dict) else {}
        if "coef" not in given:
            resolved[key] = {**given, "coef": 0.0}
    return resolved
