"""format_plan(plan): the device map as text, the way `hpcrl plan` prints it."""
from __future__ import annotations

from hpcrl.placement.memory import GIB, human_bytes
from hpcrl.placement.plan import Plan
from hpcrl.placement.rank_groups import GROUP_KINDS

CODES = {"actor_train": "AT", "actor_infer": "AI", "reference": "REF", "critic": "CR", "reward": "RW", "env": "ENV"}


def _runs(values) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5'."""
    values = list(values)
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            first, last = values[start], values[i - 1]
            out.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(out)


def _groups(groups: list[list[int]]) -> str:
    if all(len(g) == 1 for g in groups):
        return "size 1 (each rank on its own)"
    return " ".join(f"[{_runs(g) if len(g) > 2 else ','.join(map(str, g))}]" for g in groups)


def _grid(plan: Plan, cell) -> list[str]:
    """One row per node, one column per device; `cell(slot)` gives the text of a slot."""
    per_node = plan.devices_per_node
    cells = [[cell(node * per_node + d) for d in range(per_node)] for node in range(plan.nodes)]
    width = max(3, max(len(c) for row in cells for c in row))
    label = len(f"node {plan.nodes - 1}")
    lines = [("  " + " " * label + "  " + "  ".join(f"d{d}".ljust(width) for d in range(per_node))).rstrip()]
    for node, row in enumerate(cells):
        lines.append(f"  {f'node {node}'.ljust(label)}  " + "  ".join(c.ljust(width) for c in row).rstrip())
    return lines


def _checkpoint_line(plan: Plan) -> str:
    c = plan.checkpoint
    line = (f"checkpoint: {human_bytes(c.bytes)} (trained weights + optimizer state), about {c.seconds:.0f} s to "
            f"write and hash at {c.gbps:g} GB/s per node from {c.nodes} node(s)")
    if c.window_s is not None:
        line += f"; the warning signal comes {c.window_s} s before the time limit"
    if c.too_slow:
        line += (f"\nWARNING: the checkpoint may not be saved within the warning window (it starts when the step "
                 f"in flight ends): give the profile's slurm.signal more seconds (e.g. B:USR2@{int(c.seconds * 2) + 120}"
                 "), or checkpoint.every to save "
                 f"regularly (checkpoint_write_gbps {c.gbps:g}: measure yours with bench/checkpoint_bench.py)")
    return line


def format_plan(plan: Plan) -> str:
    """Per stage the nodes x devices grid with the role(s) on each slot, then each role's layout and memory."""
    used = plan.used_slots
    lines = [f"plan for job {plan.job or '?'} on cluster {plan.cluster or '?'}: {plan.nodes} node(s) x "
             f"{plan.devices_per_node} {plan.device} devices, {plan.device_memory_gb:g} GB each",
             f"world_size {plan.world_size}: rank 0 is the controller (no device); ranks 1-{plan.world_size - 1} "
             f"on the {len(used)} used slots, in slot order"]
    lines.append("")
    lines.append("world rank of each slot")
    lines += _grid(plan, lambda s: f"r{plan.rank_of_slot(s)}" if s in used else ".")

    present = [name for name in CODES if name in plan.roles]
    node_gb = f" of {plan.node_memory_gb:g} GB" if plan.node_memory_gb else ""
    for stage in plan.stages.values():
        lines.append("")
        active = ", ".join(stage.active) or "none (controller only)"
        peak = max(stage.slot_memory_gb.values(), default=0.0)
        host = [n for n in plan.roles if n not in stage.resident]
        joiner = " or " if stage.follows else ", "
        alongside = f" (alongside {joiner.join(stage.overlaps)}: rollout.max_staleness >= 1)" if stage.overlaps else ""
        if stage.moves:
            moves = f"offload at entry {', '.join(stage.offload) or '-'}"
        else:
            moves = f"moves nothing at entry, resident as in {' / '.join(stage.follows)}"
        lines.append(f"stage {stage.name}{alongside}: active {active}; resident {', '.join(stage.resident) or '-'}; "
                     f"in host memory {', '.join(host) or '-'}; {moves}; "
                     f"peak {human_bytes(peak * GIB)} of {plan.device_memory_gb:g} GB per device; "
                     f"host memory {human_bytes(max(stage.node_host_gb.values(), default=0.0) * GIB)} per node{node_gb}")

        def cell(slot: int, stage=stage) -> str:
            codes = []
            for name in plan.roles_on_slot(slot):
                code = CODES[name]
                if name in stage.active:
                    codes.append(code)
                elif plan.on_device(name, stage.name):
                    part_time = any(name not in plan.stages[w].resident for w in stage.follows)
                    codes.append(code.lower() + ("*" if part_time else ""))
                else:
                    codes.append("~" + code.lower())
            return "+".join(codes) or "."
        lines += _grid(plan, cell)
    lines.append("")
    lines.append("legend: " + ", ".join(f"{CODES[n]} {n}" for n in present)
                 + "; UPPER active, lower idle on the device, ~lower in host memory (a shared slot's inactive roles), "
                 "lower* on the device during one of the stages it runs alongside only, . unused")

    if plan.checkpoint is not None:
        lines += ["", _checkpoint_line(plan)]
    lines.append("")
    lines.append("roles (groups in Megatron order tp-cp-ep-dp-pp, as world ranks)")
    for name, role in plan.roles.items():
        p = role.parallel
        colocated = f", colocated with {role.colocate_with}" if role.colocate_with else ""
        if name == "actor_infer" and plan.rollout_shares_weights:
            colocated += ", sampling with actor_train's own weights (no copy, no weight sync)"
        lines.append(f"  {name} ({role.engine}{colocated}): tp{p['tp']} pp{p['pp']} cp{p['cp']} ep{p['ep']} "
                     f"dp{p['dp']} on node{'s' if len(role.nodes) > 1 else ''} {role.node_range}, slots {_runs(role.slots)}, ranks {_runs(role.ranks)}; "
                     f"active in {', '.join(role.stages) or 'no stage'}")
        for kind in GROUP_KINDS:
            lines.append(f"    {kind:<3} {_groups(role.rank_groups[kind])}")
        lines.append(f"    memory per device: {role.memory.describe()}")
        by_stage = []
        for stage, gb in role.memory_gb.items():
            by_stage.append(f"{stage} {human_bytes(gb * GIB) if plan.on_device(name, stage) else '0 (in host memory)'}")
        lines.append("    by stage: " + ", ".join(by_stage))
    return "\n".join(lines) + "\n"
