"""The megatron training engine: megatron-core GPTModel with TP/PP/DP and the distributed optimizer.

It implements hpcrl.engines.base.TrainingEngine like the torch engine, from the same HF files
(so both start from the same weights), with the same losses (hpcrl.engines.objective). One
instance lives on every rank of the role; `groups` are this rank's process groups of the role
(see `groups.py`: every world rank creates them, collectively, before any engine is built).
Forward and backward run through megatron-core's pipeline schedules, also when pp = 1, over
micro-batches cut by `train.micro_batch_size` / `train.max_tokens_per_micro_batch`. Every public
method runs inside the CPU shim's scope (a no-op with a GPU).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.config.job import JobConfig
from hpcrl.engines.batch import unpad
from hpcrl.engines.dp_reduce import DataParallelReducer
from hpcrl.engines.hf_model import DTYPES
from hpcrl.engines.expert_load import ExpertLoad
from hpcrl.engines.router_replay import MegatronReplay, padded_routing
from hpcrl.engines.lr_schedule import set_learning_rate
from hpcrl.engines.megatron.cpu_shim import on_cpu_shim
from hpcrl.engines.megatron.groups import default_group_is, gloo_twin, pg_collection
from hpcrl.engines.megatron.model import build_gpt_model, load_gpt_weights
from hpcrl.engines.offload import model_state_tensors, release, restore
from hpcrl.engines.megatron.packing import causal_mask, equal_micro_batches, pack
from hpcrl.engines.micro_batches import micro_batching
from hpcrl.engines.model_files import ModelFiles
from hpcrl.engines.objective import combine_micro_metrics, policy_objective, trained_mask, trained_tokens
from hpcrl.engines.megatron.vocab_parallel import vocab_parallel_logprobs
from hpcrl.engines.resharding import GPTShape, gather_hf
from hpcrl.engines.torch_trainer import Samples, split_for_all
from hpcrl.ragged import Ragged


class MegatronTrainer:
    @on_cpu_shim
    def __init__(self, files: ModelFiles, job: JobConfig, pad_id: int,
                 groups: Mapping[str, dist.ProcessGroup | None], device: str | torch.device = "cpu",
                 trainable: bool = True):
        """Each rank reads its own slices of `files` (model.load_gpt_weights, once megatron's DDP
        has laid out its buffers); `device` is the current CUDA device's (Megatron allocates on it)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        self.job = job
        self.pad_id = pad_id
        self.groups = groups
        self.pgc = pg_collection(groups)
        # each replica gathers its TP shards among its own ranks; experts split over EP ranks are
        # gathered from the replicas that hold them (EP ranks are DP ranks of the dense layers)
        self.gather_replicas = self.pgc.ep.size()
        self.shape = GPTShape.from_hf(files.config())
        self.model = build_gpt_model(files, self.pgc, job.seed, DTYPES[job.model.dtype],
                                     recompute=trainable and job.train.recompute)
        self.gpt = getattr(self.model, "module", self.model)  # the GPTModel inside Float16Module
        self.config = self.gpt.config
        self.device = next(self.gpt.parameters()).device
        self.dp_reducer = DataParallelReducer(self.pgc.dp, self.device)
        # every MoE layer's all-to-all pairs the EP ranks (DP ranks of the dense layers) micro-batch
        # by micro-batch: with ep > 1 they all run as many as the one that cuts most
        self.micro_batch_peers = DataParallelReducer(self.pgc.dp if self.pgc.ep.size() > 1 else None, self.device)
        self.forward_backward = partial(get_forward_backward_func(pp_size=self.pgc.pp.size()),
                                        p2p_communicator=P2PCommunicator(self.pgc.pp, self.config),
                                        pg_collection=self.pgc)
        self.optimizer = None
        self._expert_load: ExpertLoad | None = None   # a MoE model's routing, counted while a train step runs
        self._keep: torch.Tensor | None = None        # the real tokens of the training forward under way
        self._real_tokens = 0.0                       # the minibatch's, over the DP ranks
        self._replays: list[MegatronReplay] = []      # this stage's routers' (algorithm.router_replay)
        self._host: list = []   # host copies of the offloaded state, kept for the next offload
        self._away = False
        if not trainable:
            load_gpt_weights(self.gpt, files, self.pgc)
            self.model.requires_grad_(False)
            self.model.eval()
            return
        self._count_routing()
        if job.algorithm.router_replay:
            self._replay_routing()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        self.model = DistributedDataParallel(self.config, ddp_config, self.model, pg_collection=self.pgc)
        load_gpt_weights(self.gpt, files, self.pgc)   # into DDP's buffer, before the optimizer copies fp32 masters
        dtype = self.config.params_dtype
        train = job.train
        with default_group_is(self.pgc.intra_dist_opt):  # all ranks of the role
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=train.lr, weight_decay=train.weight_decay,
                                clip_grad=train.grad_clip or 0.0, bf16=dtype == torch.bfloat16,
                                fp16=dtype == torch.float16, params_dtype=dtype, use_distributed_optimizer=True),
                [self.model], use_gloo_process_groups=False, pg_collection=self.pgc)
        self.config.no_sync_func = self.model.no_sync
        # hpcrl's losses are normalised by minibatch totals already: gradients are summed over
        # micro-batches and DP ranks (calculate_per_token_loss) and never rescaled by a token count.
        self.config.finalize_model_grads_func = (
            lambda model, num_tokens, pg_collection=None, force_all_reduce=False:
            finalize_model_grads(model, None, pg_collection=self.pgc, force_all_reduce=force_all_reduce))

    # ---- forward ---------------------------------------------------------------------------------------------------

    def _micro_batches(self, samples: Samples) -> list[tuple[np.ndarray, dict[str, torch.Tensor]]]:
        """(rows, packed tensors) of each micro-batch: each at its own width when pp = 1, at the
        step's common width (equal sizes) when stages exchange activations."""
        prompts, responses = samples.prompt_ids, samples.response_ids
        cut = micro_batching(self.job.train, joined=True)
        pp = self.pgc.pp.size()
        peers = self.micro_batch_peers
        if pp == 1:
            groups = split_for_all(cut, prompts, responses, peers)
            shape = {}
        else:
            groups = equal_micro_batches(cut, prompts.lengths, responses.lengths, pp)
            if peers.group is not None:
                groups = equal_micro_batches(cut, prompts.lengths, responses.lengths, pp,
                                             at_least=peers.max(len(groups)))
            shape = {"width": max(1, cut.width(prompts.lengths, responses.lengths)),
                     "resp_width": max(1, responses.max_length())}
        micro = [(rows, pack(prompts.take(rows), responses.take(rows), self.pad_id,
                             {k: v.take(rows) for k, v in samples.columns.items()}, **shape,
                             multiple=self.pgc.tp.size() if self.config.sequence_parallel else 1))
                 for rows in groups]
        if samples.routed_experts is not None and self._replays:
            for rows, mb in micro:
                mb["routed_experts"] = padded_routing(samples.routed_experts.take(rows), prompts.lengths[rows],
                                                      responses.lengths[rows], self.config.num_layers,
                                                      self.config.moe_router_topk, width=mb["tokens"].shape[1])
        return micro

    def _run(self, micro: list[tuple[np.ndarray, dict[str, torch.Tensor]]], loss_func, forward_only: bool
             ) -> list[dict]:
        """Forward (and backward) over the micro-batches; the loss outputs of the last stage."""
        batches = [{k: v.to(self.device) for k, v in mb.items()} for _, mb in micro]

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            length = mb["tokens"].shape[1]
            positions = torch.arange(length, device=self.device).expand_as(mb["tokens"])
            if self._expert_load is not None and not forward_only:   # the routers count its real tokens
                self._keep = self._routed_tokens(mb["token_mask"])
            forced = self._routed_tokens(mb["routed_experts"]) if "routed_experts" in mb else None
            for replay in self._replays:   # kept for a recomputed forward (pp = 1: before the next)
                replay.forced = forced
            output = model(mb["tokens"], positions, causal_mask(length, self.device))
            self._keep = None
            return output, partial(loss_func, mb)

        try:
            return self.forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                         model=[self.model], num_microbatches=len(batches),
                                         seq_length=batches[0]["tokens"].shape[1],
                                         micro_batch_size=batches[0]["tokens"].shape[0], forward_only=forward_only)
        finally:   # the replayed routing goes with the call, also when it fails
            for replay in self._replays:
                replay.forced = None

    def _routed_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] values of the tokens (which are real, the experts to replay) as a router of this
        rank sees the tokens: megatron runs [L, N] (sequence first), each TP rank its chunk of the
        positions under sequence parallelism."""
        by_position = per_token.transpose(0, 1)
        if self.config.sequence_parallel:
            by_position = by_position.chunk(self.pgc.tp.size())[self.pgc.tp.rank()]
        return by_position.reshape(-1, *per_token.shape[2:])

    def _replay_routing(self) -> None:
        """Each router of this stage replays the rollout's routing of the micro-batch under way
        (hpcrl.engines.router_replay.MegatronReplay, in megatron-core's hook for replay)."""
        from megatron.core.transformer.moe.router import TopKRouter

        def seen(own: torch.Tensor, forced: torch.Tensor) -> None:
            if self._expert_load is not None and self._keep is not None:
                self._expert_load.count_replay(own, forced, self._keep)

        for module in self.gpt.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = MegatronReplay(module, seen)
                self._replays.append(module.router_replay)

    def _count_routing(self) -> None:
        """Hooks on the MoE layers: their routers count, during a train step's forwards, where the
        real tokens go (the routing map [tokens, experts] and the softmax of the logits the router
        kept: see model._route_as_transformers); each layer then adds its load-balancing loss to
        the backward through megatron's MoEAuxLossAutoScaler, weighted by its micro-batch's share
        of the minibatch's real tokens (hpcrl.engines.expert_load). A recomputed forward finds
        `_keep` cleared. Under sequence parallelism a layer's statistics are summed over the TP
        ranks first, and the loss divided by tp: the router's gradient is summed over them too."""
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        sequence_parallel = self.pgc.tp if self.config.sequence_parallel else None
        per_layer = 1.0 / self.config.num_layers   # every layer has experts (config._check_supported)
        coef = self.job.algorithm.moe_aux_loss_coef / (self.pgc.tp.size() if sequence_parallel else 1)

        def remember(router, inputs, output) -> None:
            router.last_routing_map = output[1]

        def balance(layer, inputs, output):
            router = layer.router
            logits, routing_map = router.last_logits, router.last_routing_map
            router.last_logits = router.last_routing_map = None
            if self._expert_load is None or self._keep is None:
                return None
            probs = torch.softmax(logits.reshape(routing_map.shape), dim=-1)   # logits: [S, B, E]
            stats = self._expert_load.count(router.layer_number - 1, routing_map, probs, self._keep)
            stats.reduce(sequence_parallel)
            aux = stats.aux_loss(self.config.moe_router_topk)
            self._expert_load.record(aux, stats.tokens, per_layer)
            share = coef * per_layer * stats.tokens / max(self._real_tokens, 1.0)
            return MoEAuxLossAutoScaler.apply(output[0], aux * share), output[1]

        for module in self.gpt.modules():
            if isinstance(module, MoELayer):
                module.router.register_forward_hook(remember)
                module.register_forward_hook(balance)

    def _response_logprobs(self, mb: dict[str, torch.Tensor], logits: torch.Tensor,
                           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, R] log-probabilities (and entropy) of the response tokens under softmax(logits / T)."""
        # the response positions first: the fp32 vocabulary math then covers R positions, not L
        index = mb["index"]
        logits = torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return vocab_parallel_logprobs(logits / self.job.rollout.temperature, torch.gather(mb["targets"], 1, index),
                                       self.pgc.tp, with_entropy)

    @property
    def _last_stage(self) -> bool:
        return self.pgc.pp.rank() == self.pgc.pp.size() - 1

    @on_cpu_shim
    @torch.no_grad()
    def logprobs(self, prompt_ids: Ragged, response_ids: Ragged, routed_experts: Ragged | None = None
                 ) -> Ragged | None:
        """Per-token log-probabilities of the responses, on the last pipeline stage (where the
        logits are; None on the other stages); routed as the rollout routed them, given its
        `routed_experts` (algorithm.router_replay)."""
        self.model.eval()

        def loss_func(mb, logits):
            logp, _ = self._response_logprobs(mb, logits, with_entropy=False)
            return logp.sum() * 0, mb["response_mask"].sum().int(), {"logprobs": logp.cpu()}

        micro = self._micro_batches(Samples(prompt_ids, response_ids, {}, routed_experts))
        outputs = self._run(micro, loss_func, forward_only=True)
        if not self._last_stage:
            return None
        parts = [unpad(o["logprobs"], response_ids.lengths[rows]) for o, (rows, _) in zip(outputs, micro)]
        order = np.concatenate([rows for rows, _ in micro])
        return Ragged.concat(parts).take(np.argsort(order, kind="stable"))

    # ---- training --------------------------------------------------------------------------------------------------

    def _policy_loss(self, mb: dict[str, torch.Tensor], logits: torch.Tensor, tokens: float,
                     sequences: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Megatron's loss_func on the last stage: (loss share, token count, metrics)."""
        logp, entropy = self._response_logprobs(mb, logits, with_entropy=True)
        if self.job.algorithm.entropy_coef == 0:
            entropy = entropy.detach()   # logged only: no graph through it
        loss, metrics = policy_objective(logp, entropy, mb, mb["response_mask"], self.job, tokens, sequences)
        return loss, trained_mask(mb["response_mask"], mb).sum().int(), metrics

    @on_cpu_shim
    def train_step(self, samples: Samples, lr: float) -> dict[str, float]:
        """`ppo_epochs` passes over this DP shard, each in `minibatches` optimizer steps at rate `lr`;
        the metrics on the last pipeline stage ({} on the others)."""
        train = self.job.train
        set_learning_rate(self.optimizer, lr)
        n = len(samples.prompt_ids)
        if n % train.minibatches:
            raise ValueError(f"a DP shard of {n} samples does not split into train.minibatches={train.minibatches}")
        self.model.train()
        history: dict[str, list[float]] = {}
        experts = self.config.num_moe_experts
        self._expert_load = (ExpertLoad(self.config.num_layers, experts, self.config.moe_router_topk, self.device)
                             if experts else None)
        for _ in range(train.ppo_epochs):
            for index in np.array_split(np.arange(n), train.minibatches):
                minibatch = samples.take(index)
                # the global counts the shares are normalised by (and a MoE model's load-balancing weights)
                tokens, sequences, self._real_tokens = self.dp_reducer.sums(
                    [trained_tokens(minibatch.response_ids, minibatch.columns), float(len(index)),
                     float(minibatch.prompt_ids.lengths.sum() + minibatch.response_ids.lengths.sum())])
                loss_func = partial(self._policy_loss, tokens=tokens, sequences=int(sequences))
                micro = self._micro_batches(minibatch)
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                outputs = self._run(micro, loss_func, forward_only=False)
                _, grad_norm, _ = self.optimizer.step()
                if not self._last_stage:  # the loss and its metrics live on the last stage
                    continue
                metrics = combine_micro_metrics(outputs, self.pgc.dp.size())
                widths = [mb["tokens"].shape for _, mb in micro]
                real = minibatch.prompt_ids.lengths.sum() + minibatch.response_ids.lengths.sum()
                metrics["padding_fraction"] = 1.0 - float(real) / max(1, sum(r * w for r, w in widths))
                metrics["micro_batches"] = float(len(micro))
                if train.grad_clip is not None and grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                for key, value in metrics.items():
                    history.setdefault(key, []).append(value)
        metrics = {key: sum(values) / len(values) for key, values in history.items()}
        if self._expert_load is not None:   # collective over the role; reported with the loss, on the last stage
            load = self._expert_load.metrics(self.pgc.intra_dist_opt, duplicates=self.pgc.tp.size())
            self._expert_load = None
            if self._last_stage:
                metrics.update(load)
        return metrics

    # ---- weights ---------------------------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each pipeline stage's full HF-named tensors, yielded on the stage's TP rank 0 of EP rank 0
        (of every DP replica when ep = 1, of every expert-DP replica when ep > 1). Collective over
        the stage's TP and EP ranks; the other ranks yield nothing."""
        local = [(name, p.detach()) for name, p in self.gpt.named_parameters()]
        return gather_hf(local, self.shape, self.pgc.tp, self.pgc.pp.size(), self.pgc.pp.rank(), ep_group=self.pgc.ep)

    # ---- checkpoints -----------------------------------------------------------------------------------------------

    def _state_file(self, path: Path) -> Path:
        expert = f"_ep{self.pgc.ep.rank():02d}" if self.pgc.ep.size() > 1 else ""
        return Path(path) / f"tp{self.pgc.tp.rank():02d}{expert}_pp{self.pgc.pp.rank():03d}.pt"

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer])) if self.optimizer else []

    def _stepped(self) -> bool:
        """Whether the optimizer holds state: megatron-core allocates it in the first step, and before
        (e.g. the actor during PPO's critic warm-up) its state dicts and gathers fail on the missing state."""
        return any(opt.optimizer.state for opt in self._optimizers())

    @on_cpu_shim
    def save_state(self, path: Path) -> None:
        """One file per (TP, EP, PP) coordinate, written by its expert-DP rank 0 (the DP rank 0 when
        ep = 1; Megatron's own layout of a torch checkpoint): the model shard, the optimizer's
        common state, and the distributed optimizer's shards gathered over DP (the dense
        parameters' to DP rank 0, in the file of EP rank 0; the experts' over expert DP), so the
        state loads on any DP size (same TP, EP and PP). Collective over the role's DP groups.
        An optimizer that has not stepped saves no state (None): it loads as fresh as it was."""
        stepped = self._stepped()
        param_states = ([opt.get_parameter_state_dp_zero(use_gloo_comm=False) for opt in self._optimizers()]
                        if stepped else None)
        if self.pgc.expt_dp.rank() != 0:
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        model = {k: v for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        common = self.optimizer.state_dict() if stepped else None
        torch.save({"model": model, "optimizer": common, "param_states": param_states}, self._state_file(path))

    @torch.no_grad()
    @on_cpu_shim
    def load_state(self, path: Path) -> None:
        file = self._state_file(path)
        if not file.exists():
            raise FileNotFoundError(f"{file}: no Megatron state for TP rank {self.pgc.tp.rank()}, EP rank "
                                    f"{self.pgc.ep.rank()}, PP rank {self.pgc.pp.rank()}; a Megatron checkpoint "
                                    "resumes with the same tp, ep and pp")
        state = torch.load(file, map_location="cpu", weights_only=False)
        missing, unexpected = self.gpt.load_state_dict(state["model"], strict=False)
        real_missing = [k for k in missing if not k.endswith("_extra_state")]
        if real_missing or unexpected:
            raise RuntimeError(f"{file}: the model shard does not fit this model: missing {real_missing}, "
                               f"unexpected {unexpected}")
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            for opt, param_state in zip(self._optimizers(), state["param_states"]):
                first = dist.get_rank(opt.data_parallel_group) == 0   # the rank that gathered it
                opt.data_parallel_group_gloo = gloo_twin(self.groups, opt.data_parallel_group)
                # megatron-core copies every per-parameter state entry from the file, which holds
                # param, exp_avg and exp_avg_sq; torch's AdamW also keeps `step` there (restored
                # above from the common state), so it steps aside for the copy. megatron-core gives
                # every parameter the same step tensor, which AdamW would then advance once per
                # parameter: each gets its own copy.
                steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
                opt.load_parameter_state_from_dp_zero(param_state if first else None)
                for p, step in steps.items():
                    opt.optimizer.state[p]["step"] = step.clone()

    @on_cpu_shim
    def offload(self) -> None:
        """Weights, gradients (views of DDP's buffers) and optimizer state to host memory."""
        if not self._away:
            tensors = model_state_tensors(self.model.parameters())
            for opt in self._optimizers():
                tensors += model_state_tensors((), opt.optimizer)
            self._host = release(tensors, self._host)
            self._away = True

    @on_cpu_shim
    def reload(self) -> None:
        if self._away:
            restore(self._host)
            self._away = False

