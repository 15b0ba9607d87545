"""compile_plan(job, profile): ROLL's AutoDeviceMapping done statically, before anything is submitted.

Placement rules:

- Roles with `placement: {nodes: "a-b"}` are placed first (in declaration order): they get the
  slots of nodes a..b from the first device there that is free for them to the last device of node
  b. A device is free for a role when no role already placed on it is active in a stage the role is
  active in (a rollout-only role may time-share the devices of a train-only one; it is then
  offloaded at the stage change). tp*pp*cp*dp must equal the number of slots so given.
- The other roles without `colocate_with` follow in declaration order: each takes fresh slots (held
  by no role), filling nodes in order and skipping the remainder of a node that cannot hold a whole
  TP group, so that every TP group stays inside one node.
- A role with `colocate_with: X` gets X's slots. Its tp*pp*cp*dp must equal X's; when it gives no
  `parallel` at all it takes X's parallel sizes.

Then every role is checked: TP groups inside one node, no two roles outside one colocation group
active on one slot in the same stage, ep dividing dp, and the memory estimate within the device.

Per stage, a role is offloaded at the stage change when it is inactive but shares a slot with an
active role, the roles of that slot are over the device's memory together, and roles.<name>.offload
allows it. Memory counts a role on a device in a stage when it is active there, may not move, or
has its slots to itself (it then stays resident while idle); an
inactive role sharing its slots waits in host memory and counts 0 (plan.resident_roles). In async
mode (rollout.max_staleness >= 1) rollout runs alongside logprobs and train, so its roles are
resident in both, and the memory check takes the peak over what overlaps. The roles on one device
add up what they hold, but only the largest working set (memory.device_bytes: one rank serves
their calls one after another). Over the device, the message names what would lower the biggest
role there, and how many devices it alone would need when no layout on the cluster fits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hpcrl.config.cluster import ClusterProfile
from hpcrl.config.job import JobConfig, Parallel
from hpcrl.engines.capabilities import (MODEL_PARALLEL, ModelDims, megatron_model_refusals, parallel_refusals,
                                       role_refusals)
from hpcrl.placement.errors import PlacementError
from hpcrl.placement.memory import (DTYPE_BYTES, GENERATION_ROLES, GIB, TRAINING_ROLES, MemoryEstimate, ModelShape,
                                    count_parameters, device_bytes, estimate_role_memory, hf_config, human_bytes,
                                    kv_bytes_per_token)
from hpcrl.placement.plan import (CONSUMPTION, PRODUCTION, STAGES, CheckpointEstimate, Plan, RolePlan, StagePlan,
                                  kept_residency, resident_roles, residency_windows)
from hpcrl.placement.rank_groups import megatron_groups


@dataclass(frozen=True)
class _Role:
    name: str
    engine: str
    parallel: Parallel
    stages: tuple[str, ...]
    colocate_with: str | None
    nodes: str | None  # explicit placement.nodes

    @property
    def world(self) -> int:
        return self.parallel.world

    @property
    def sizes(self) -> str:
        return f"tp*pp*cp*dp = {self.world}"

    @property
    def factors(self) -> str:
        p = self.parallel
        return f"tp {p.tp}, pp {p.pp}, cp {p.cp}, dp {p.dp}"


def _describe_slot(slot: int, per_node: int) -> str:
    return f"slot {slot} (node {slot // per_node}, device {slot % per_node})"


def _resolve_roles(job: JobConfig) -> dict[str, _Role]:
    """Each role's parallel sizes, stages and colocation target, with the colocation links checked."""
    configs = dict(job.roles.items())
    for name, config in configs.items():
        target = config.colocate_with
        if target is None:
            continue
        if target == name:
            raise PlacementError(f"roles.{name}.colocate_with: a role cannot colocate with itself")
        if target not in configs:
            raise PlacementError(f"roles.{name}.colocate_with: {target!r} is not a role of this job "
                                 f"(roles: {', '.join(configs)})")
        if config.placement is not None:
            raise PlacementError(f"roles.{name}: give either placement or colocate_with, not both "
                                 f"(a colocated role uses the slots of {target})")
        chain, current = [name], target
        while current is not None:
            if current in chain:
                raise PlacementError(f"roles.{name}.colocate_with: colocation cycle {' -> '.join(chain + [current])}; "
                                     "one role of the cycle must be placed on its own")
            chain.append(current)
            current = configs[current].colocate_with

    def parallel_of(name: str) -> Parallel:
        config = configs[name]
        if config.colocate_with is not None and "parallel" not in config.model_fields_set:
            return parallel_of(config.colocate_with)
        return config.parallel

    roles = {name: _Role(name=name, engine=job.engine(name), parallel=parallel_of(name), stages=job.stages(name),
                         colocate_with=config.colocate_with,
                         nodes=config.placement.nodes if config.placement is not None else None)
             for name, config in configs.items()}
    if "env" in roles and roles["env"].world > roles["actor_infer"].parallel.dp:
        rollout = roles["actor_infer"].parallel.dp
        raise PlacementError(f"roles.env.parallel: {roles['env'].world} env ranks for {rollout} rollout ranks "
                             f"(roles.actor_infer) would leave some idle; use at most {rollout}")
    return roles


GPU_ONLY_ENGINES = ("vllm",)


def _model_dims(shape: ModelShape) -> ModelDims:
    widths = (shape.intermediate_size, shape.expert_intermediate_size, shape.shared_expert_intermediate_size)
    return ModelDims(shape.num_heads, shape.num_kv_heads, shape.vocab_size, shape.num_layers, shape.num_experts,
                     tuple(width for width in widths if width))


def _check_capabilities(job: JobConfig, roles: dict[str, _Role], shape: ModelShape) -> None:
    """What the engines would refuse at start-up (engines/capabilities.py, the table they check too),
    for the resolved sizes (a colocated role inherits its target's), and a model.path whose
    config.json the megatron engine cannot convert."""
    dims = _model_dims(shape)
    for role in roles.values():
        refused = role_refusals(role.name, role.engine) + parallel_refusals(
            role.name, role.engine, role.parallel.model_dump(), dims)
        if refused:
            raise PlacementError("; ".join(refused))
    megatron = [f"roles.{name}" for name, role in roles.items() if role.engine == "megatron"]
    if job.model.path and megatron:
        path, config = hf_config(job.model)
        refused = megatron_model_refusals(config)
        if refused:
            raise PlacementError(f"model.path: {path} has {'; '.join(refused)}. The megatron engine of "
                                 f"{', '.join(megatron)} would refuse it at start-up: give them engine torch "
                                 "(fsdp: true to shard it) or deepspeed")


def _check_parallel(roles: dict[str, _Role], profile: ClusterProfile) -> None:
    for role in roles.values():
        p = role.parallel
        if role.engine in GPU_ONLY_ENGINES and profile.device != "cuda":
            raise PlacementError(f"roles.{role.name}.engine: {role.engine} runs on GPUs only, and cluster "
                                 f"{profile.name} has device: {profile.device}; use engine: native here "
                                 "(it runs everywhere) or a GPU cluster profile")
        if p.tp > profile.devices_per_node:
            raise PlacementError(f"roles.{role.name}.parallel: tp = {p.tp} but a node of cluster {profile.name} has "
                                 f"{profile.devices_per_node} devices, so a TP group would cross nodes; keep "
                                 f"tp <= {profile.devices_per_node} and raise pp or dp instead")


class _Placer:
    """Assigns slots to roles in the order described in the module docstring."""

    def __init__(self, roles: dict[str, _Role], profile: ClusterProfile):
        self.roles = roles
        self.profile = profile
        self.per_node = profile.devices_per_node
        self.slots: dict[str, list[int]] = {}

    def run(self) -> dict[str, list[int]]:
        own = [r for r in self.roles.values() if r.colocate_with is None]
        for role in [r for r in own if r.nodes is not None] + [r for r in own if r.nodes is None]:
            self.slots[role.name] = self._explicit(role) if role.nodes is not None else self._default(role)
            self._colocate()
        return {name: self.slots[name] for name in self.roles}

    def _holders(self, slot: int) -> list[str]:
        return [name for name, slots in self.slots.items() if slot in slots]

    def _colocate(self) -> None:
        changed = True
        while changed:
            changed = False
            for role in self.roles.values():
                target = role.colocate_with
                if target is None or role.name in self.slots or target not in self.slots:
                    continue
                given = self.slots[target]
                if role.world != len(given):
                    raise PlacementError(
                        f"roles.{role.name}.parallel: {role.sizes} but colocate_with: {target} gives "
                        f"{len(given)} slots ({role.factors}); a colocated role must have the same world size as {target} "
                        f"(e.g. drop parallel to inherit {target}'s, or set its dp to {len(given)} // (tp*pp*cp))")
                self.slots[role.name] = list(given)
                changed = True

    def _explicit(self, role: _Role) -> list[int]:
        text = role.nodes
        first, _, last = text.partition("-")
        first, last = int(first), int(last or first)
        nodes = self.profile.nodes
        if first > last:
            raise PlacementError(f'roles.{role.name}.placement.nodes "{text}": the first node is after the last')
        if last >= nodes:
            raise PlacementError(
                f'roles.{role.name}.placement.nodes "{text}": cluster {self.profile.name} has {nodes} node(s), '
                f"0-{nodes - 1}; the job needs more slots than the cluster has. Use nodes within 0-{nodes - 1}, "
                "lower the parallel sizes, or use a profile with more nodes")
        span = range(first * self.per_node, (last + 1) * self.per_node)
        busy: dict[int, list[str]] = {}
        for slot in span:
            clash = [h for h in self._holders(slot) if set(self.roles[h].stages) & set(role.stages)]
            if clash:
                busy[slot] = clash
        free = [slot for slot in span if slot not in busy]
        given = [slot for slot in span if free and slot >= free[0]]
        if len(given) != role.world:
            holders = sorted({h for hs in busy.values() for h in hs})
            shared = [s for s in role.stages if any(s in self.roles[h].stages for h in holders)]
            held = (f"{len(busy)} of its {len(span)} devices are held by {', '.join(holders)}, active in stage "
                    f"{', '.join(shared)} too")
            if not given:
                raise PlacementError(
                    f'roles.{role.name}.parallel: {role.sizes} but placement.nodes "{text}" gives 0 slots ({held}); '
                    f"choose other nodes, or use colocate_with instead of placement to share a role's devices")
            detail = f" ({held}; the role takes the devices from the first free one on)" if busy else ""
            raise PlacementError(
                f'roles.{role.name}.parallel: {role.sizes} but placement.nodes "{text}" gives {len(given)} slots'
                f"{detail}; make tp*pp*cp*dp ({role.factors}) equal {len(given)} or change placement.nodes")
        return given

    def _default(self, role: _Role) -> list[int]:
        tp, need = role.parallel.tp, role.world
        chosen: list[int] = []
        free_total = 0
        for node in range(self.profile.nodes):
            node_free = [s for s in range(node * self.per_node, (node + 1) * self.per_node) if not self._holders(s)]
            free_total += len(node_free)
            take = min(len(node_free) // tp * tp, need - len(chosen))
            chosen += node_free[:take]
        if len(chosen) < need:
            usable = len(chosen)  # short of need, so this is every slot usable as whole TP groups
            held = {s for slots in self.slots.values() for s in slots}
            later = [r for r in self.roles.values() if r.colocate_with is None and r.nodes is None
                     and r.name not in self.slots and r.name != role.name]
            needed = len(held) + need + sum(r.world for r in later)
            p = self.profile
            whole = "" if usable == free_total else f" ({usable} of them usable as whole TP groups of {tp} in a node)"
            after = f" after {', '.join(self.slots)}" if self.slots else ""
            raise PlacementError(
                f"roles.{role.name}.parallel: needs {role.sizes} slots ({role.factors}) but only {free_total} of the cluster's "
                f"{p.slots} are free{after}{whole}. The job needs {needed} device slots and cluster {p.name} has "
                f"{p.slots} ({p.nodes} node(s) x {p.devices_per_node} devices): lower dp (or tp/pp), share devices "
                "with colocate_with, or use a profile with more nodes")
        return chosen


def _check_tp_in_node(roles: dict[str, _Role], slots: dict[str, list[int]], per_node: int) -> None:
    for name, role in roles.items():
        tp = role.parallel.tp
        mine = slots[name]
        for start in range(0, len(mine), tp):
            group = mine[start:start + tp]
            nodes = sorted({s // per_node for s in group})
            if len(nodes) > 1:
                how = (f"colocate_with: {role.colocate_with} gives slots {mine}" if role.colocate_with
                       else f"its slots are {mine}")
                raise PlacementError(
                    f"roles.{name}.parallel: the TP group on slots {group} crosses nodes {', '.join(map(str, nodes))} "
                    f"({how}); a TP group must stay inside one node: change tp or the placement")


def _rollout_shares_weights(job: JobConfig, slots: dict[str, list[int]]) -> bool:
    """Whether rollout samples with the trainer's own parameters (rollout.share_trainer_weights): the
    native sampler on exactly the ranks of a DDP torch trainer, whose fp32 weights are the ones it
    would be sent, and a synchronous pipeline, so that rollout never runs while they change; not with
    context parallelism (the trainer's attention then needs its cp peers)."""
    return (job.rollout.share_trainer_weights and job.rollout_logprobs_are_trainers()
            and not job.roles.actor_train.fsdp and job.roles.actor_train.parallel.cp == 1
            and job.rollout.max_staleness == 0 and slots["actor_infer"] == slots["actor_train"])


def _colocation_root(roles: dict[str, _Role], name: str) -> str:
    while roles[name].colocate_with is not None:
        name = roles[name].colocate_with
    return name


def _check_stage_conflicts(roles: dict[str, _Role], slots: dict[str, list[int]], per_node: int) -> None:
    for stage in STAGES:
        seen: dict[int, str] = {}
        for name, role in roles.items():
            if stage not in role.stages:
                continue
            for slot in slots[name]:
                other = seen.get(slot)
                if other is None:
                    seen[slot] = name
                elif _colocation_root(roles, other) != _colocation_root(roles, name):
                    raise PlacementError(
                        f"roles.{name}.placement: {name} and {other} are both active in stage {stage} on "
                        f"{_describe_slot(slot, per_node)} but are not colocated; give them separate nodes "
                        f"(placement.nodes), or set roles.{name}.colocate_with: {other} instead of a placement "
                        "if they may share the devices")


def _crowded(name: str, slots: dict[str, list[int]], memory: dict[str, MemoryEstimate], device_gb: float) -> bool:
    """Whether the roles holding one of `name`'s slots are over the device's memory together: only
    then must the idle ones make room (a move costs a copy each way and a round trip of the stage)."""
    return any(device_bytes(memory[other] for other, theirs in slots.items() if slot in theirs) / GIB > device_gb
               for slot in slots[name])


def _stage_plans(job: JobConfig, roles: dict[str, _Role], slots: dict[str, list[int]],
                 memory: dict[str, MemoryEstimate], shared_weights: bool, device_gb: float) -> dict[str, StagePlan]:
    """Per stage: who is active, who is resident (plan.resident_roles over the stage's residency
    window) and who goes to host memory at its entry. A role moves only when it holds device memory,
    the roles sharing one of its devices do not fit there together, and its roles.<name>.offload
    allows it, and the trainer never when rollout samples with its weights (`shared_weights`). A
    stage that moves nothing (async rollout and reward; scoring on the controller) takes the
    residency of the stages it follows: the union of theirs."""
    asynchronous = job.rollout.max_staleness > 0
    needs_room = {stage for name, role in roles.items() if memory[name].total > 0 for stage in role.stages}
    windows = residency_windows(asynchronous, needs_room)
    facts = {name: (tuple(slots[name]), role.stages, getattr(job.roles, name).offload and memory[name].total > 0
                    and not (shared_weights and name == "actor_train") and _crowded(name, slots, memory, device_gb))
             for name, role in roles.items()}
    resident = {stage: resident_roles(window, facts) for stage, window in windows.items()}
    stages = {}
    for stage in STAGES:
        active = {name: tuple(slots[name]) for name, role in roles.items() if stage in role.stages}
        overlaps = (CONSUMPTION if stage in PRODUCTION else PRODUCTION) if asynchronous else ()
        follows = () if stage in windows else kept_residency(stage, windows, asynchronous)
        here = resident[stage] if stage in windows else tuple(
            name for name in roles if any(name in resident[w] for w in follows))
        busy = {s for name in here for s in slots[name]}
        offload = tuple(name for name in roles if name not in here and busy & set(slots[name])) if not follows else ()
        stages[stage] = StagePlan(name=stage, active=active, resident=here, offload=offload, overlaps=overlaps,
                                  moves=not follows, follows=follows)
    return stages


def _slot_memory(stage: StagePlan, stages: dict[str, StagePlan], slots: dict[str, list[int]],
                 memory: dict[str, MemoryEstimate]) -> dict[int, float]:
    """GB per used slot while `stage` runs: what its residents hold together (device_bytes), or the
    peak over the stages it follows."""
    if stage.follows:
        kept = [_slot_memory(stages[s], stages, slots, memory) for s in stage.follows]
        return {slot: max(k[slot] for k in kept) for slot in kept[0]}
    return {slot: device_bytes(memory[name] for name in stage.resident if slot in slots[name]) / GIB
            for ss in slots.values() for slot in ss}


def _dp_lowers(job: JobConfig, role: str) -> bool:
    """Whether raising dp lowers the role's share of a device: Megatron's distributed optimizer and
    ZeRO shard a trainer's optimizer state over it, FSDP2 and ZeRO-3 any role's weights; a rollout
    replica then generates fewer sequences at once."""
    zero = job.zero_stage(role)
    return (zero >= 3 or role in GENERATION_ROLES
            or (role in TRAINING_ROLES and (job.engine(role) == "megatron" or zero >= 1)))


def _layout_fix(job: JobConfig, role: _Role, estimate: MemoryEstimate, profile: ClusterProfile) -> str:
    """What lowers `role`'s share of a device: vLLM's pool; the sizes its engine can still raise (tp
    up to a node, pp, cp, and dp where it shards state); a trainer's activations."""
    if role.engine == "vllm":   # it takes its share whatever it holds (the plan checks its weights fit)
        return (f"lower rollout.gpu_memory_utilization ({job.rollout.gpu_memory_utilization:g}: vLLM takes that "
                "share of each device whatever it needs)")
    p = role.parallel
    axes = [axis for axis in MODEL_PARALLEL.get(role.engine, ()) if axis != "ep"
            and (axis != "tp" or p.tp < profile.devices_per_node)]
    axes += ["dp"] if _dp_lowers(job, role.name) else []
    fixes = [f"raise {' or '.join(axes)} of {role.name} (now {', '.join(f'{a} {getattr(p, a)}' for a in axes)})"
             ] if axes else [f"{role.name} ({role.engine}) splits no further"]
    if role.name in TRAINING_ROLES and estimate.working > estimate.total / 2:
        fixes.append("keep fewer activations (train.recompute: true, a smaller train.micro_batch_size or "
                     "model.max_position_embeddings)")
    if estimate.part("KV cache"):
        fixes.append("cap rollout.max_num_seqs, or lower train.prompts_per_step or model.max_position_embeddings "
                     "(the KV cache)")
    return ", or ".join(fixes)


def _devices_note(job: JobConfig, role: _Role, shape: ModelShape, profile: ClusterProfile) -> str:
    """When no layout of `role` fits on this cluster: how many devices one would need."""
    need = _devices_needed(job, role, shape, profile)
    if need is None:
        return f"; no layout of {role.name} fits a {profile.device_memory_gb:g} GB device"
    if need.world > profile.slots:
        return (f"; no layout of {role.name} fits on the cluster's {profile.slots} devices: alone it needs at least "
                f"{need.world} (tp {need.tp}, pp {need.pp}, cp {need.cp}, dp {need.dp})")
    return ""


def _devices_needed(job: JobConfig, role: _Role, shape: ModelShape, profile: ClusterProfile) -> Parallel | None:
    """The smallest layout of `role` alone (its engine's axes, tp within a node and the largest first,
    dp splitting a minibatch) whose estimate fits the device, up to 64 times the cluster; None when
    none does."""
    p, dims = role.parallel, _model_dims(shape)
    per_node, axes = profile.devices_per_node, MODEL_PARALLEL.get(role.engine, ())
    samples = job.train.prompts_per_step * job.algorithm.group_size // job.train.minibatches
    tps = [t for t in range(per_node, 0, -1) if per_node % t == 0] if "tp" in axes else [p.tp]
    pps = [q for q in range(1, shape.num_layers + 1) if shape.num_layers % q == 0] if "pp" in axes else [p.pp]
    dps = [d for d in range(1, samples + 1) if samples % d == 0]
    layouts = sorted((Parallel(tp=t, pp=q, cp=p.cp, ep=p.ep, dp=d) for t in tps for q in pps for d in dps
                      if t * q * p.cp * d <= 64 * profile.slots), key=lambda layout: layout.world)
    return next((layout for layout in layouts
                 if not parallel_refusals(role.name, role.engine, layout.model_dump(), dims)
                 and estimate_role_memory(role.name, job, shape, layout, profile.device_memory_gb).gb
                 <= profile.device_memory_gb), None)


def _check_memory(job: JobConfig, stages: dict[str, StagePlan], slots: dict[str, list[int]],
                  memory: dict[str, MemoryEstimate], roles: dict[str, _Role], shape: ModelShape,
                  profile: ClusterProfile) -> dict[str, StagePlan]:
    """Fill each stage's per-slot memory; reject the worst (stage, slot) when it is over the device."""
    worst = None
    filled = {}
    for name, plan in stages.items():
        per_slot = _slot_memory(plan, stages, slots, memory)
        if plan.moves:
            for slot, total in sorted(per_slot.items()):
                if worst is None or total > worst[0]:
                    worst = (total, name, slot)
        filled[name] = replace(plan, slot_memory_gb=per_slot)
    if worst is not None and worst[0] > profile.device_memory_gb:
        total, stage, slot = worst
        here = stages[stage]
        resident = [n for n in here.resident if slot in slots[n]]
        biggest = max(resident, key=lambda n: memory[n].total)
        # the same peak in a stage where the biggest role works says more than one where it idles
        stage = next((name for name, plan in filled.items() if plan.moves and name in roles[biggest].stages
                      and plan.slot_memory_gb[slot] >= total - 1e-9), stage)
        here = stages[stage]
        parts = " + ".join(f"{n} {memory[n].describe()}" for n in resident)
        fix = _layout_fix(job, roles[biggest], memory[biggest], profile)
        kept = [n for n in resident if n not in here.active and not getattr(job.roles, n).offload]
        if kept:
            fix += f", or let {', '.join(kept)} leave the device while idle (roles.<name>.offload: true)"
        # name the stage the biggest role works in, and the stages running beside it on this slot
        window = (stage, *here.overlaps)
        named = next((s for s in window if s in roles[biggest].stages), stage) if biggest not in here.active else stage
        beside = [s for s in window if s != named and any(s in roles[n].stages for n in resident)]
        overlapped = [n for n in resident if set(roles[n].stages) & set(here.overlaps)]
        if beside and overlapped:
            fix += (f"; with rollout.max_staleness {job.rollout.max_staleness} {', '.join(overlapped)} runs alongside "
                    f"{stage} and cannot time-share these devices: give it devices of its own, or set "
                    "rollout.max_staleness: 0 so the stages take turns")
        elif len(resident) > 1:
            fix += ", or place the roles on separate devices"
        fix += _devices_note(job, roles[biggest], shape, profile)
        where = f" (alongside {', '.join(beside)})" if beside else ""
        raise PlacementError(
            f"roles.{biggest}.parallel: the memory estimate in stage {named}{where} is {total:.2f} GB on "
            f"{_describe_slot(slot, profile.devices_per_node)}, over the device's {profile.device_memory_gb:g} GB "
            f"(device_memory_gb of cluster {profile.name}): {parts}. Fix: {fix}")
    return filled


def _host_memory(job: JobConfig, stages: dict[str, StagePlan], slots: dict[str, list[int]],
                 memory: dict[str, MemoryEstimate], roles: dict[str, _Role], shape: ModelShape,
                 profile: ClusterProfile) -> dict[str, StagePlan]:
    """Host memory per node in each stage: the state of the roles waiting there (weights, gradients,
    optimizer state; vLLM's weights, asleep) and the trainer's staged weights (one copy in the job's
    dtype, split over the first replica's pipeline-stage leaders). Over the node's memory
    (slurm.mem), the plan is refused: the job would be OOM-killed at its first stage change."""
    trainer = roles["actor_train"].parallel
    local = megatron_groups(tp=trainer.tp, pp=trainer.pp, cp=trainer.cp, ep=trainer.ep, dp=trainer.dp)
    leaders = [slots["actor_train"][i] for i in next(g for g in local["pp"] if 0 in g)]
    staged = count_parameters(shape) * DTYPE_BYTES[job.model.dtype] / trainer.pp
    per_node = profile.devices_per_node
    filled = {}
    for name, stage in stages.items():
        host = {node: 0.0 for node in sorted({s // per_node for ss in slots.values() for s in ss})}
        for slot in leaders:
            host[slot // per_node] += staged / GIB
        away = [n for n in roles if n not in stage.resident]
        for role in away:
            for slot in slots[role]:
                host[slot // per_node] += memory[role].state / GIB
        filled[name] = replace(stage, node_host_gb=host)
        limit = profile.node_memory_gb
        node, total = max(host.items(), key=lambda item: item[1])
        if limit is not None and total > 0.9 * limit:
            waiting = ", ".join(f"{n} {human_bytes(memory[n].state)} per device" for n in away) or "nothing"
            raise PlacementError(
                f"roles.{max(away, key=lambda n: memory[n].state) if away else 'actor_train'}.offload: in stage {name} node {node} holds {total:.1f} GB "
                f"in host memory ({waiting} waiting there, and the staged weights), over 90% of the "
                f"{limit:g} GB a node gets (slurm.mem of cluster {profile.name}). Fix: raise slurm.mem, keep a role "
                "on its devices (roles.<name>.offload: false, if the devices hold it), or spread the roles over "
                "more nodes")
    return filled


def _check_vllm_pool(job: JobConfig, roles: dict[str, _Role], memory: dict[str, MemoryEstimate],
                     profile: ClusterProfile, shape: ModelShape) -> None:
    """vLLM must fit the weights and the KV cache of one sequence of the whole context into its
    share of the device: it refuses to start otherwise (its own check, at the context it serves)."""
    if "actor_infer" not in roles or job.engine("actor_infer") != "vllm":
        return
    pool = job.rollout.gpu_memory_utilization * profile.device_memory_gb
    weights = memory["actor_infer"].part("weights") / GIB
    one_sequence = kv_bytes_per_token(job, shape, roles["actor_infer"].parallel) * shape.max_position_embeddings / GIB
    if weights + one_sequence >= 0.9 * pool:
        raise PlacementError(
            f"rollout.gpu_memory_utilization: vLLM's share of a {profile.device_memory_gb:g} GB device is "
            f"{pool:.2f} GB; the rollout weights take {weights:.2f} GB per device and one sequence of the "
            f"{shape.max_position_embeddings} positions of the context {one_sequence:.2f} GB of KV cache, which vLLM "
            "must fit to start. Fix: raise rollout.gpu_memory_utilization or roles.actor_infer.parallel.tp, or cap "
            "the context with model.max_position_embeddings")


def _check_batches(job: JobConfig, roles: dict[str, _Role]) -> None:
    """Every trainer replica gets the same share of a step's samples, and the share splits into
    `train.minibatches` (else a train step would fail, or some replicas train on more)."""
    samples = job.train.prompts_per_step * job.algorithm.group_size
    for name in ("actor_train", "critic"):
        role = roles.get(name)
        if role is None:
            continue
        dp, minibatches = role.parallel.dp, job.train.minibatches
        if samples % (dp * minibatches):
            raise PlacementError(
                f"train.prompts_per_step x algorithm.group_size = {samples} samples per step do not split into "
                f"roles.{name}.parallel.dp = {dp} replicas x train.minibatches = {minibatches}: make the product "
                f"{job.train.prompts_per_step} x {job.algorithm.group_size} a multiple of {dp * minibatches}")


def _check_context(job: JobConfig, shape: ModelShape) -> None:
    """A response must fit the model's context with room for a prompt (longer prompts are left out
    at load, with a count in the log)."""
    key = "env.max_tokens" if job.env is not None else "rollout.max_new_tokens"
    if job.response_budget() >= shape.max_position_embeddings:
        raise PlacementError(
            f"{key}: {job.response_budget()} response tokens leave no room for a prompt in the model's context of "
            f"{shape.max_position_embeddings} positions (model.max_position_embeddings); lower {key} or raise "
            "model.max_position_embeddings (up to what the model supports)")


def compile_plan(job: JobConfig, profile: ClusterProfile) -> Plan:
    """The static device map of `job` on `profile`; raises PlacementError naming the role and field."""
    roles = _resolve_roles(job)
    shape = ModelShape.from_model(job.model)
    _check_capabilities(job, roles, shape)
    _check_context(job, shape)
    _check_parallel(roles, profile)
    _check_batches(job, roles)
    per_node = profile.devices_per_node
    slots = _Placer(roles, profile).run()
    _check_tp_in_node(roles, slots, per_node)
    _check_stage_conflicts(roles, slots, per_node)

    shared_weights = _rollout_shares_weights(job, slots)
    memory = {name: estimate_role_memory(name, job, shape, role.parallel, profile.device_memory_gb,
                                         shared_weights=shared_weights)
              for name, role in roles.items()}
    _check_vllm_pool(job, roles, memory, profile, shape)
    stages = _stage_plans(job, roles, slots, memory, shared_weights, profile.device_memory_gb)
    stages = _check_memory(job, stages, slots, memory, roles, shape, profile)
    stages = _host_memory(job, stages, slots, memory, roles, shape, profile)

    used = sorted({s for ss in slots.values() for s in ss})
    rank = {slot: 1 + index for index, slot in enumerate(used)}
    role_plans = {}
    for name, role in roles.items():
        mine = slots[name]
        p = role.parallel
        local = megatron_groups(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp)
        groups = {kind: [[mine[i] for i in group] for group in gs] for kind, gs in local.items()}
        role_plans[name] = RolePlan(
            name=name, engine=role.engine, parallel={"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "dp": p.dp},
            slots=tuple(mine), ranks=tuple(rank[s] for s in mine),
            nodes=tuple(sorted({s // per_node for s in mine})), groups=groups,
            rank_groups={kind: [[rank[s] for s in group] for group in gs] for kind, gs in groups.items()},
            stages=tuple(s for s in STAGES if s in role.stages), colocate_with=role.colocate_with,
            memory=memory[name],
            memory_gb={stage: memory[name].total / GIB if name in stages[stage].resident else 0.0
                       for stage in STAGES})
    return Plan(world_size=1 + len(used), nodes=profile.nodes, devices_per_node=per_node, roles=role_plans,
                stages=stages, job=job.name, cluster=profile.name, device=profile.device,
                device_memory_gb=profile.device_memory_gb, node_memory_gb=profile.node_memory_gb,
                rollout_shares_weights=shared_weights,
                checkpoint=_checkpoint_estimate(job, profile, shape, role_plans))


def _checkpoint_estimate(job: JobConfig, profile: ClusterProfile, shape: ModelShape,
                         roles: dict[str, RolePlan]) -> CheckpointEstimate:
    """The trained roles' weights and optimizer state (Adam's two moments in fp32, and fp32 master
    weights under a 16-bit dtype), written and read back (hashed) by the nodes holding them."""
    per_param = DTYPE_BYTES[job.model.dtype] + 8 + (4 if DTYPE_BYTES[job.model.dtype] < 4 else 0)
    trained = [r for name, r in roles.items() if name in TRAINING_ROLES]
    size = sum(count_parameters(shape, head="value" if r.name == "critic" else "lm") * per_param for r in trained)
    nodes = len({n for r in trained for n in r.nodes}) or 1
    seconds = 2 * size / 1e9 / (profile.checkpoint_write_gbps * nodes)
    window = None
    if profile.slurm is not None:
        window = int(profile.slurm.signal.split("@")[1]) if "@" in profile.slurm.signal else 60
    return CheckpointEstimate(size, seconds, nodes, profile.checkpoint_write_gbps, window)
