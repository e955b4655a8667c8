"""Everything that touches torchtitan 0.2.2's internals.

`install()` makes every construction of torchtitan's CheckpointManager yield
`TieredCheckpointManager` when `[checkpoint] tier_local = true`, by overriding
`CheckpointManager.__new__`. That works under plain `torchrun -m torchtitan.train`
(where the trainer module is `__main__` and patching `torchtitan.train` would not)
and for any other trainer that builds a CheckpointManager.
"""

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components import checkpoint as tt_checkpoint
from torchtitan.components.optimizer import OptimizersContainer, OptimizersInBackwardContainer
from torchtitan.tools.logging import logger

from titan_ckpt_plus import config, cpu_fallback, digest, faults, flavors, identity, priority
from titan_ckpt_plus.adapters import torchtitan_v022_data
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.optimizer_state import OptimizerStateCache
from titan_ckpt_plus.placement import PlacementError, ReplicaPlacement
from titan_ckpt_plus.policy.ledger import FAILURE_CLASSES, FailureLedger
from titan_ckpt_plus.policy.schedule import IntervalPolicy
from titan_ckpt_plus.staging import copy_into
from titan_ckpt_plus.telemetry import EventLog, peak_rss_since_last
from titan_ckpt_plus.tiers.files import atomic_write_json
from titan_ckpt_plus.tiers.local import JobLock, claim_job_dir, job_dir, node_jobs
from titan_ckpt_plus.tiers.pfs import PfsTier, agree, describe

_StockManager = tt_checkpoint.CheckpointManager


class TieredCheckpointManager(_StockManager):
    """torchtitan's CheckpointManager with a node-local tier in front of its folder.

    The PFS tier is torchtitan's own `folder`, in its own DCP layout, filled in the
    background from committed local steps.
    """

    def __init__(self, dataloader, model_parts, optimizers, lr_schedulers, states,
                 checkpoint_config, sd_adapter, base_folder: str = "", ft_manager=None) -> None:
        config.validate(checkpoint_config, base_folder)
        if ft_manager is not None and getattr(ft_manager, "enabled", False):
            raise config.ConfigError(
                "[checkpoint] tier_local = true is not supported with torchft "
                "([fault_tolerance] enable = true). Fix: set tier_local = false.")
        super().__init__(dataloader, model_parts, optimizers, lr_schedulers, states,
                         checkpoint_config, sd_adapter, base_folder, ft_manager)
        self.tiered: TieredCheckpointer | None = None
        self._job_lock: JobLock | None = None
        if not self.enable:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        in_backward = isinstance(optimizers, OptimizersInBackwardContainer)
        if in_backward and rank == 0:
            logger.info("[titan_ckpt_plus] [optimizer] early_step_in_backward = true: the "
                        "parameters change during backward, so each save's copy finishes "
                        "before the next step starts (no overlap with forward/backward)")
        self.job = self._establish_identity(checkpoint_config.adopt_job, base_folder)
        node_folder = config.resolve_local_folder(checkpoint_config.local_folder)
        accelerator = cpu_fallback.accelerator_present()
        fills_cores = cpu_fallback.training_fills_cores(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        settings = TierSettings(
            local_root=job_dir(node_folder, self.job.job_id),
            pfs_folder=self.folder,
            local_interval=checkpoint_config.local_interval,
            pfs_interval=checkpoint_config.interval,
            local_keep=checkpoint_config.local_keep_latest_k,
            pfs_keep=checkpoint_config.keep_latest_k,
            pfs_reuse_files=checkpoint_config.pfs_reuse_files,
            rank=rank,
            world_size=world,
            first_on_node=int(os.environ.get("LOCAL_RANK", "0")) == 0,
            job_id=self.job.job_id,
            layout_tags=self._layout_tags(),
            pin=torch.cuda.is_available(),
            replication_backend=checkpoint_config.replication_backend,
            overlap_copy=not in_backward,
            staging_copy=config.staging_copy(checkpoint_config, accelerator, fills_cores),
            last_step_export=self._last_step_is_export(),
            background_nice=config.background_nice(checkpoint_config, accelerator),
            background_idle=config.background_idle(checkpoint_config, priority.can_leave_idle()),
            helper_process=getattr(checkpoint_config, "helper_process", False) and not self.load_only,
            # a look saves nothing: no hub process for it
            agreements="gloo" if self.load_only else getattr(checkpoint_config, "agreements", "auto"),
            local_reshard=getattr(checkpoint_config, "local_reshard", True),
            drain_start=getattr(checkpoint_config, "drain_start", "auto"),
            read_only=self.load_only,
        )
        # load_only (a look at a step, saving nothing) leaves the job's records as they were:
        # its start would read as an incarnation that failed, and shorten the job's intervals.
        records = rank == 0 and not self.load_only
        events_path = os.path.join(base_folder, identity.PLUGIN_DIR, "events.jsonl")
        self.events = EventLog(events_path if records else None)
        settings.node_ranks = self._survey_nodes(base_folder, node_folder, settings)
        placement = self._placement(checkpoint_config, world)
        policy = self._interval_policy(checkpoint_config)
        self._optimizer_state = self._optimizer_state_cache()
        self._digests = digest.DigestLog(os.environ.get(digest.DIGEST_ENV), rank)
        self._saving_step = -1
        self.tiered = TieredCheckpointer(settings, self._capture, self.events, placement, policy,
                                         adaptive=checkpoint_config.adaptive_interval)
        ledger_path = os.path.join(base_folder, identity.PLUGIN_DIR, "ledger.jsonl")
        self.ledger = FailureLedger(ledger_path) if records else None
        self.incarnation = f"{int(time.time())}-{os.getpid()}"
        trainer = states.get(tt_checkpoint.TRAIN_STATE)
        self._warn_slow_bf16(trainer, rank)
        self._metrics_logger = getattr(getattr(trainer, "metrics_processor", None), "logger", None)
        self._wandb_declared = False
        self._last_heartbeat = 0.0
        if self.ledger:
            self.events.submit(self.ledger.start, self.incarnation, t=time.time(), world_size=world)
        self._grace_s = checkpoint_config.preemption_grace_s
        self._sigterm_at: float | None = None
        # a look (load_only) saves nothing: a preemption notice ends it as it ends stock's run
        if self._grace_s > 0 and not self.load_only and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        policy_key = getattr(checkpoint_config, "background_policy", "auto")
        logger.info(f"[titan_ckpt_plus] tiers on, job {self.job.job_id}: local {settings.local_root} every "
                    f"{settings.local_interval} steps, PFS {self.folder} every "
                    f"{settings.pfs_interval} steps; its threads "
                    + ("in SCHED_IDLE while on time" if settings.background_idle
                       else f"at nice +{settings.background_nice}")
                    + f" (background_policy {policy_key!r}"
                    + ("; not SCHED_IDLE: a late thread could not leave it, no CAP_SYS_NICE)"
                       if policy_key == "auto" and not settings.background_idle else ")")
                    + ("; local data files written by a helper process" if self.tiered.helper else ""))
        note = config.async_mode_note(checkpoint_config)
        if note and rank == 0:
            logger.info(f"[titan_ckpt_plus] {note}")
        if policy_key == "idle" and not settings.background_idle:
            logger.warning('[titan_ckpt_plus] [checkpoint] background_policy = "idle" cannot be honoured: '
                           "a thread in SCHED_IDLE could not come back when its work is late (needs "
                           "CAP_SYS_NICE or RLIMIT_NICE >= 20). The threads stay in the normal class. Fix: "
                           'grant CAP_SYS_NICE (a container: --cap-add SYS_NICE) or raise RLIMIT_NICE to 20 '
                           '(limits.conf "nice"), or set "normal" or "auto".')

    @staticmethod
    def _placement(ckpt, world: int) -> ReplicaPlacement | None:
        """Replica placement checked against every rank's failure domain (host and
        torchrun node rank, from the launcher), before any training step."""
        if ckpt.replication_factor == 0:
            return None
        if ckpt.replication_backend == "nccl" and not torch.cuda.is_available():
            raise config.ConfigError(
                '[checkpoint] replication_backend = "nccl" needs GPUs. Fix: use "gloo".')
        domains: list = [None] * world
        dist.all_gather_object(domains, f"{socket.gethostname()}/node{config.node_rank()}")
        jump = ckpt.replication_jump or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        try:
            return ReplicaPlacement(world, ckpt.replication_factor, jump, tuple(domains))
        except PlacementError as e:
            raise config.ConfigError(str(e)) from None

    @staticmethod
    def _interval_policy(ckpt) -> IntervalPolicy:
        """Sets the intervals with adaptive_interval; otherwise it only says what it
        would choose, for the dashboard."""
        return IntervalPolicy(ckpt.min_interval, ckpt.max_interval, ckpt.mtbf_prior_hours * 3600,
                              ckpt.pfs_mtbf_prior_hours * 3600, ckpt.mtbf_prior_weight,
                              use_daly=ckpt.interval_formula == "daly")

    def _ledger_after_recovery(self, tier: str | None, step: int, seconds: float) -> None:
        """Record how this start recovered, then hand every rank the same failure
        evidence (rank 0 reads the ledger) for the interval policy."""
        evidence = None
        if self.ledger:  # at start-up, before the first step: reading here is fine
            self.events.flush()
            before = self.ledger.read(current_incarnation=self.incarnation)
            if len(before.incarnations) > 1:  # an earlier incarnation exists: a restart
                self.ledger.recovery(self.incarnation, time.time(), tier, max(step, 0), seconds)
            summary = self.ledger.read(current_incarnation=self.incarnation)
            evidence = {c: summary.evidence(c) for c in FAILURE_CLASSES}
            logger.info(f"[titan_ckpt_plus] failure ledger: {summary.count('any')} failures, "
                        f"{summary.count('unrecoverable_local')} not recoverable locally, over "
                        f"{summary.exposure_s / 3600:.3g} h")
        box = [evidence]
        dist.broadcast_object_list(box, src=0, group=self.tiered.commit_pg)
        self.tiered.policy.evidence = box[0]
        if tier is not None:
            self.tiered.policy.controller.observe_restart(seconds)

    def _establish_identity(self, adopt: str, base_folder: str) -> identity.JobIdentity:
        """Collective: the job's identity, decided on rank 0 from the dump folder (see
        identity.py). A PFS folder holding another job's steps is refused here, before
        anything is written: loading them would be another job's state, and this
        job's saves and retention would mix with them."""
        box: list = [(None, [], [], "")]
        if dist.get_rank() == 0:
            path = identity.job_file(base_folder)
            try:  # whatever fails, every rank must hear of it, or the others would hang
                est = identity.establish(base_folder, adopt)
                refusal = self._foreign_pfs_steps(est.identity.job_id, base_folder)
                if not refusal:
                    identity.commit(est)
                box = [(est.identity, est.warnings, est.notes, refusal)]
            except OSError as e:
                box = [(None, [], [], f"cannot read or write the job identity {path} or the PFS folder "
                        f"{self.folder} ({e}). It is not replaced: a new identity would orphan this "
                        "job's checkpoints. Fix: check that [job] dump_folder is readable and "
                        "writable from rank 0's node, then start again")]
            except Exception as e:
                box = [(None, [], [], f"establishing the job identity {path} failed: {e!r}")]
        dist.broadcast_object_list(box, src=0)
        job, warnings, notes, refusal = box[0]
        for w in warnings:
            logger.warning(f"[titan_ckpt_plus] {w}")
        for n in notes:
            logger.info(f"[titan_ckpt_plus] {n}")
        if refusal:
            raise config.ConfigError(refusal)
        return job

    def _foreign_pfs_steps(self, job_id: str, base_folder: str) -> str:
        """"" or the refusal: which steps of `self.folder` another job wrote, and the fixes."""
        other = PfsTier(self.folder, 0, 1, 0, job_id).other_jobs_steps()
        if not other:
            return ""
        jobs = sorted(set(other.values()))
        return (f"[checkpoint] folder {self.folder} holds steps {sorted(other)} of job(s) {jobs}, "
                f"not of this job ({job_id}, dump folder {os.path.realpath(base_folder)}): "
                "they are never loaded, and this job will not write beside them. Fix: to continue "
                f"that job here, set [checkpoint] adopt_job = '{jobs[0]}' (and do not restart the "
                "job that wrote them); to start fresh, move that folder aside; to start from one of "
                "its steps as a new job, move it out and set initial_load_path to it.")

    def _layout_tags(self) -> list[dict]:
        """Collective: every rank's layout tag, so a part held for another rank is
        checked against what that rank expects, not against the holder's layout."""
        tags: list = [None] * dist.get_world_size()
        dist.all_gather_object(tags, self._layout_tag(dist.get_world_size()))
        return tags

    def _survey_nodes(self, base_folder: str, node_folder: str, s: TierSettings) -> list[int]:
        """Collective, at start: the node's first rank claims the job's subfolder of the
        node folder (lock, JOB.json) and lists the other jobs' steps there; rank 0 logs
        those once per node and writes every node's job folder to local_roots.json, so
        `titan-ckpt ls` finds a run's local steps from its dump folder. Returns the
        ranks that share this rank's node folder (recorded in COMMIT.json, so tools can
        tell own parts from replicas)."""
        problem, others = "", []
        if s.first_on_node:
            self._job_lock, problem = claim_job_dir(s.local_root, dict(
                self.job.to_json(), host=socket.gethostname(), pid=os.getpid(), started_at=time.time()),
                look=self.load_only)
            others = [j for j in node_jobs(node_folder) if j.job_id != s.job_id]
        where: list = [None] * dist.get_world_size()
        dist.all_gather_object(where, {"host": socket.gethostname(), "root": s.local_root,
                                       "problem": problem, "others": [j.summary() for j in others]})
        problems = [w["problem"] for w in where if w["problem"]]
        if problems:
            raise config.ConfigError("; ".join(problems))
        if dist.get_rank() == 0:
            path = os.path.join(base_folder, identity.PLUGIN_DIR, "local_roots.json")
            try:  # for the tools only: not worth stopping the job (or hanging the others)
                if not self.load_only:  # a look's nodes need not be the job's
                    atomic_write_json(path, sorted({w["root"] for w in where}))
            except OSError as e:
                logger.warning(f"[titan_ckpt_plus] could not write {path}: {e!r}")
            for w in where:
                if w["others"]:
                    folder = os.path.dirname(w["root"])
                    logger.warning(
                        f"[titan_ckpt_plus] {w['host']}:{folder} holds other jobs' local steps, "
                        "ignored (never loaded, never deleted by this job): "
                        + "; ".join(j["text"] for j in w["others"]))
                    self.events.record("foreign_local_steps", host=w["host"], folder=folder,
                                       jobs=w["others"])
        return [r for r, w in enumerate(where) if (w["host"], w["root"]) == (socket.gethostname(), s.local_root)]

    # ---- what is saved --------------------------------------------------------

    def _optimizer_state_cache(self) -> OptimizerStateCache | None:
        """Only for torchtitan's own container: a subclass may override state_dict()."""
        opt = self.states.get(tt_checkpoint.OPTIMIZER)
        if isinstance(opt, OptimizersContainer) and type(opt).state_dict is OptimizersContainer.state_dict:
            return OptimizerStateCache(opt.model_parts, opt.optimizers)
        return None

    def _state(self, keys=None) -> dict:
        """The same state stock torchtitan hands to dcp.save, with every Stateful
        resolved to its state_dict(), so DCP sees identical keys after the drain
        (`keys`: those alone; an optimizer's state_dict() before its first step would
        make its state, torch's _init_optim_state: a step at lr 0, one Adam step early)."""
        cached = self._optimizer_state
        # A tensor is tested first: isinstance against the Stateful protocol inspects the
        # object's attributes, a cost paid per parameter on the training thread.
        return {k: cached.state_dict() if cached is not None and k == tt_checkpoint.OPTIMIZER
                else v if isinstance(v, torch.Tensor) or not isinstance(v, Stateful) else v.state_dict()
                for k, v in self._flattened_model_states_sd().items() if keys is None or k in keys}

    def _capture(self) -> dict:
        """The state at this save point, for the tiers (and its digest: a test hook)."""
        state = self._state()
        self._digests.record("save", self._saving_step, state, dist.get_world_size())
        return state

    def _layout_tag(self, world: int) -> dict:
        """What a local step must match to be loaded by this job: world size and how
        each parameter is sharded. Read from the model wrapper's cached state dict, so
        computing it has no side effects (the optimizer is not touched)."""
        rows = []
        for k, v in self.states[tt_checkpoint.MODEL].state_dict().items():
            spec = getattr(v, "_spec", None)
            local = v.to_local() if spec is not None else v
            rows.append([k, str(v.dtype), list(local.shape),
                         str(spec.placements) if spec else "", list(spec.mesh.shape) if spec else []])
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
        return {"world_size": world, "model": digest}

    # ---- torchtitan's API -----------------------------------------------------

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if self.tiered is None or self.load_only:
            super().save(curr_step, last_step)
        else:
            first = curr_step == 1 and self.enable_first_step_checkpoint
            self._saving_step = curr_step
            self.tiered.save(curr_step, last_step or first)
            if last_step and self.tiered.s.last_step_export:
                self._export_last_step(curr_step)
            saved_now = self.tiered.schedule.last_local == curr_step
            if self.ledger and (saved_now or time.monotonic() - self._last_heartbeat > 5):
                self._last_heartbeat = time.monotonic()
                self.events.submit(self.ledger.heartbeat, self.incarnation, t=time.time(), step=curr_step)
            if self.ledger and last_step:  # flushed: both tiers hold the last step
                self.events.submit(self.ledger.clean_end, self.incarnation, t=time.time())
            self._log_metrics(curr_step)
            if (self._grace_s > 0 and not last_step
                    and self.tiered.preemption_agreed(self._sigterm_at is not None)):
                self._stop_for_preemption(curr_step)
        faults.maybe_delay("slow_step", curr_step)
        faults.maybe_kill("kill_after_step", curr_step)
        faults.maybe_preempt(curr_step)

    # ---- the last step's export ---------------------------------------------------

    def _last_step_is_export(self) -> bool:
        """Whether torchtitan's last step writes an export (model only, or HF) rather than
        the full state: then step-N is the export and the full state goes beside it."""
        return bool(self.last_save_model_only or self.last_save_in_hf)

    def _export_last_step(self, step: int) -> None:
        """torchtitan's own export at the last step, written by its own code to its own
        step-N (model only in export_dtype, DCP or HF safetensors through the model's
        state-dict adapter), after the full state is on both tiers. A failed export is
        logged and counted; the full state stays, so the job can still resume."""
        pfs = self.tiered.pfs
        fmt = "HF safetensors" if self.last_save_in_hf else "DCP"
        what = f"model only, {str(self.export_dtype).replace('torch.', '')}" \
            if self.last_save_model_only else "full state"
        t0 = time.monotonic()
        try:
            pfs.prepare_export(step, self.tiered.commit_pg)
            self._save_last_step(step)  # stock: synchronous, on every rank
            nbytes = pfs.record_export(step, fmt, str(self.export_dtype)) if dist.get_rank() == 0 else 0
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self.tiered.record_failure("export", step, describe(e))
            return
        seconds = time.monotonic() - t0
        if dist.get_rank() == 0:
            logger.info(f"[titan_ckpt_plus] last step {step}: torchtitan's export ({what}, {fmt}) at "
                        f"{pfs.export_dir(step)} in {seconds:.2f}s; the full state for resuming is "
                        f"in the local tier and at {pfs.step_dir(step)}")
        self.events.record("export", step=step, path=pfs.export_dir(step), format=fmt,
                           model_only=bool(self.last_save_model_only),
                           dtype=str(self.export_dtype), bytes=nbytes, seconds=seconds)

    # ---- preemption -----------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        """A preemption notice: only noted here; the ranks agree on it at the next
        step (see TieredCheckpointer.preemption_agreed)."""
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
            logger.warning(f"[titan_ckpt_plus] SIGTERM: preemption notice, stopping within "
                           f"{self._grace_s:g}s")

    def _sigterm_ends_a_failed_run(self) -> None:
        """Training raised: a SIGTERM now is the launcher stopping the workers, a peer
        having died, and the flush in close() may wait for that peer's vote. Only
        noted, it left the rank waiting for torchrun's SIGKILL 30 s later, which
        delayed the restart by as much; it now ends the rank at once, as in stock
        torchtitan, and one noted already does so now. The error is logged first:
        ended by the signal, the rank prints no traceback."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            return  # not ours (preemption_grace_s = 0, or a look): the default or the user's
        logger.error("[titan_ckpt_plus] training failed; closing (a SIGTERM ends this rank at once)",
                     exc_info=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._sigterm_at is not None:
            signal.raise_signal(signal.SIGTERM)

    def _stop_for_preemption(self, step: int) -> None:
        """Finish the save in flight, promote the newest local step to the PFS, and
        end training at this step; torchtitan then closes and exits normally. A
        watchdog ends the process if that overruns the grace period."""
        noticed = self._sigterm_at or time.monotonic()
        deadline = noticed + self._grace_s
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), self._overdue)
        watchdog.daemon = True
        watchdog.start()
        reserve = min(5.0, 0.2 * self._grace_s)  # for closing and torchtitan's exit
        pfs_step, what = self.tiered.promote_newest(deadline - reserve)
        seconds = time.monotonic() - noticed
        logger.warning(f"[titan_ckpt_plus] preempted at step {step}: {what}; newest PFS step "
                       f"{pfs_step}; stopping {seconds:.1f}s after the notice")
        self.events.record("preemption", step=step, pfs_step=pfs_step, action=what,
                           seconds=seconds, grace_s=self._grace_s)
        if self.ledger:  # a preemption is not a failure: the work up to now is saved
            self.events.submit(self.ledger.clean_end, self.incarnation, t=time.time())
        trainer = self.states[tt_checkpoint.TRAIN_STATE]  # torchtitan's Trainer
        trainer.job_config.training.steps = step  # the loop ends after this step

    @staticmethod
    def _warn_slow_bf16(trainer, rank: int) -> None:
        """CPU fallback only: bf16 mixed precision on a CPU that multiplies it slowly."""
        job, dims = getattr(trainer, "job_config", None), getattr(trainer, "parallel_dims", None)
        if rank != 0 or job is None or dims is None:
            return
        why = cpu_fallback.slow_bf16_warning(job.training.mixed_precision_param, dims.fsdp_enabled)
        if why:
            logger.warning(f"[titan_ckpt_plus] {why}")

    def _overdue(self) -> None:
        logger.error(f"[titan_ckpt_plus] preemption grace of {self._grace_s:g}s is over; "
                     "exiting now")
        self.events.flush()
        os._exit(1)

    def _log_metrics(self, step: int) -> bool:
        """Checkpoint figures that became known since the last step, logged at this
        step through torchtitan's loggers (wandb, tensorboard) on rank 0; returns
        whether any were. What has to wait for a later step
        (telemetry.EventLog.take_metrics) is logged at the next."""
        metrics = self.events.take_metrics()  # taken here too, or they would pile up
        if not metrics or self._metrics_logger is None:
            return False
        self._declare_wandb_metrics()
        self._metrics_logger.log(metrics, step)
        return True

    def _log_leftovers(self) -> None:
        """At close(), once the event thread is flushed: what still waits (a late commit
        that landed with the last step's, the last save's interval review) goes to the
        steps after the last one. Not from the last step's save(): torchtitan's
        validation logs that step after it, and wandb drops a step older than its
        latest."""
        step = max(self._saving_step, 0) + 1
        try:
            while self._log_metrics(step):
                step += 1
        except Exception as e:  # a logger already closed: the events file keeps them
            logger.warning(f"[titan_ckpt_plus] checkpoint metrics after the last step not logged: {e!r}")

    def _declare_wandb_metrics(self) -> None:
        if self._wandb_declared:
            return
        self._wandb_declared = True
        # torchtitan's wandb logger has imported it if enabled; importing it here
        # would cost the training loop about 0.25 s.
        wandb = sys.modules.get("wandb")
        try:
            if wandb is not None and wandb.run is not None:
                wandb.define_metric("ckpt/*", step_metric=None)
        except Exception:
            pass

    def maybe_wait_for_staging(self) -> None:
        if self.tiered is None:
            return super().maybe_wait_for_staging()
        self.tiered.wait_for_staging()

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        if self.tiered is None:
            return super().load(step)
        try:
            return self._load(step)
        finally:
            if self.load_only:  # a look reads the node folders no more: the job may restart there
                self._release_job_lock()

    def _load(self, step: int) -> bool:
        if step == 0:  # the model-only seed checkpoint, loaded as stock does; the steps after it go
            loaded = super().load(step)
            if loaded:
                self.tiered.resumed_at(0)
            return loaded
        t0 = time.monotonic()
        rec = self.tiered.recover(lambda reader: reader.load(self._states_to_load(model_only=False)),
                                  only_step=step)  # load_step: from whichever tier holds it
        for tier, s, why in rec.skipped:
            logger.warning(f"[titan_ckpt_plus] skipped {tier} step {s}: {why}")
        if rec.tier is None:
            self._ledger_after_recovery(None, -1, time.monotonic() - t0)
            if step != -1 and rec.steps_found:
                refuse_a_missing_load_step(step, rec)
            if rec.skipped:  # this job has steps, and none fits: starting over would lose them
                raise RuntimeError(
                    "[titan_ckpt_plus] this job has checkpoints but none can be loaded here "
                    "(see the warnings above: a failed check, or local steps of another "
                    "parallel layout with a part held on no node, with no PFS step to reshard from); "
                    "refusing to load a "
                    "corrupt one or to silently start over. Fix: restart with the layout "
                    "they were saved with, or move "
                    f"{self.folder} and the local folders aside to start from scratch"
                    + (", or run once without load_only (it fetches the parts the node folders lack)"
                       if self.load_only else "") + ".")
            return super().load(step)  # nothing of ours: initial_load_path / HF as stock
        refuse_a_partial_state(rec)
        model_only = rec.step == 0  # a seed checkpoint: from the PFS alone, as stock loads it
        self._load_chosen(rec, model_only)
        pfs_total = torch.tensor([rec.bytes_read["pfs"]], dtype=torch.int64)
        dist.all_reduce(pfs_total, group=self.tiered.commit_pg)
        total = dict(rec.bytes_total, pfs=int(pfs_total.item()))
        seconds = time.monotonic() - t0
        source = "local" if rec.tier == "local" and not total["peer"] else rec.tier
        if rec.tier == "local" and total["peer"]:
            source = "local+peer"
        if rec.resharded_from:
            source = f"{source} (resharded from world size {rec.resharded_from})"
            if rec.parts_lacking:
                moved = ", ".join(f"old rank {old}'s to the node of rank {node}" for node, old in rec.parts_fetched)
                logger.info(f"[titan_ckpt_plus] node folders lacked {rec.parts_lacking} parts of step {rec.step}: "
                            f"their layouts were fetched, and the data of {len(rec.parts_fetched)} of them, "
                            f"read by a rank there ({moved or 'none'})")
        logger.info(f"[titan_ckpt_plus] recovered step {rec.step} from the {source} tier in "
                    f"{seconds:.2f}s (bytes read, all ranks: local disk {total['local']}, "
                    f"from peers {total['peer']}, pfs {total['pfs']})")
        self.tiered.resumed_at(rec.step)
        if self._digests.path:  # what the load wrote alone (after a model-only one, no optimizer)
            self._digests.record("load", rec.step, self._state(self._states_to_load(model_only)),
                                 dist.get_world_size())
        self._ledger_after_recovery(rec.tier, rec.step, seconds)
        self.events.record("recovery", step=rec.step, tier=rec.tier, source=source, seconds=seconds,
                           job_id=self.job.job_id, load_step=step,
                           bytes_local=total["local"], bytes_peer=total["peer"], bytes_pfs=total["pfs"],
                           resharded_from=rec.resharded_from, parts_fetched=rec.parts_fetched,
                           parts_lacking=rec.parts_lacking,
                           skipped=[list(x) for x in rec.skipped])
        return True

    def _load_chosen(self, rec, model_only: bool) -> None:
        """The step recover() chose, into the job's state. Collective: where the job's
        state refuses it on some ranks only (one pipeline stage's optimizer or
        dataloader), every rank raises, so none waits alone in the next collective."""
        why, err = "", None
        try:
            if rec.tier == "pfs":
                rec.bytes_read["pfs"] += self.tiered.pfs.load(rec.step, self._states_to_load(model_only))
            elif not rec.resharded_from:  # a local step of another layout: loaded by recover()
                self._load_local(rec.state)
        except Exception as e:
            why, err = repr(e), e
        why = agree(why, self.tiered.commit_pg)
        if err is not None:
            raise err
        if why:
            raise RuntimeError(f"[titan_ckpt_plus] loading {rec.tier} step {rec.step} failed on other ranks "
                               f"({why}); this rank stops with them")

    def _release_job_lock(self) -> None:
        lock, self._job_lock = getattr(self, "_job_lock", None), None
        if lock is not None:
            lock.release()

    def _load_local(self, saved: dict) -> None:
        for key, live in self._states_to_load(model_only=False).items():
            if key not in saved:
                raise ValueError(f"[titan_ckpt_plus] local checkpoint lacks {key!r}")
            if isinstance(live, Stateful):
                live.load_state_dict(copy_into(live.state_dict(), saved[key], key))
            else:
                copy_into(live, saved[key], key)

    def close(self) -> None:
        tiered, self.tiered = getattr(self, "tiered", None), None
        if tiered is not None:
            # the first close only: stock __del__ closes again, maybe in an unrelated except
            if sys.exc_info()[1] is not None:  # torchtitan closes from its except block
                self._sigterm_ends_a_failed_run()
            tiered.close()
            self.events.flush()
            self._log_leftovers()
        self._release_job_lock()
        super().close()


def refuse_a_missing_load_step(step: int, rec) -> None:
    """[checkpoint] load_step names a step no tier can load, while the job has others:
    stock torchtitan refuses it too (FileNotFoundError), here with the steps there are."""
    found = rec.steps_found[-12:]
    what = ("cannot be loaded here (see the warnings above)" if rec.skipped
            else "is held by neither the local tier nor the PFS")
    err = RuntimeError if rec.skipped else FileNotFoundError
    raise err(f"[titan_ckpt_plus] [checkpoint] load_step = {step}: step {step} {what}. This job's steps: "
              f"{found}. Fix: set load_step to one of them, or -1 for the newest that loads.")


def refuse_a_partial_state(rec) -> None:
    """A resharded local step whose load failed midway (Recovery.partly_loaded) left
    some of the state its own: only a whole state may load over it. torchtitan's PFS
    step 0 is the model alone, so the optimizer would train on with those values."""
    if rec.tier == "pfs" and rec.step == 0 and rec.partly_loaded >= 0:
        raise RuntimeError(
            f"[titan_ckpt_plus] local step {rec.partly_loaded} failed to load resharded after "
            "writing some of the state, and the only older checkpoint, PFS step 0, holds the "
            "model alone: the optimizer would keep part of step "
            f"{rec.partly_loaded}'s values. Refusing to train on that mix. Fix: restart with "
            "[checkpoint] local_reshard = false (--checkpoint.no-local-reshard) to start "
            "from step 0, or move that step's local folders aside.")


def _wants_tiers(args, kwargs) -> bool:
    cfg = kwargs.get("checkpoint_config", args[5] if len(args) > 5 else None)
    return bool(getattr(cfg, "enable", False) and getattr(cfg, "tier_local", False))


LOSS_LOG_ENV = "TITAN_CKPT_LOSS_LOG"
SCHED_LOG_ENV = "TITAN_CKPT_SCHED_LOG"


def _record_losses(path: str | None, sched_path: str | None = None) -> None:
    """Test hook: append each logged step's exact loss (repr of the float) to `path`,
    so a resumed run can be compared bit for bit with an uninterrupted one. Armed by
    the TITAN_CKPT_LOSS_LOG environment variable, for stock and tiered runs alike.
    Written by torchtitan's metrics rank (rank 0, or the last pipeline stage's).
    Benchmark hook: with TITAN_CKPT_SCHED_LOG too, every rank appends its threads'
    scheduler counters and its peak RSS since the previous logged step to
    `<that path>.<rank>`."""
    if not path:
        return
    from torchtitan.components import metrics

    original = metrics.MetricsProcessor.log
    log = EventLog(path)
    sched: list = []  # the rank's log, opened at its first step (ranks exist by then)

    def logged(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if dist.get_rank() == metrics._get_metrics_rank(self.parallel_dims, self.job_config):
            log.record("loss", step=step, loss=float(global_avg_loss))
            log.flush()  # a test hook: written before the step ends, even if killed next
        if sched_path:
            if not sched:
                sched.append(EventLog(f"{sched_path}.{dist.get_rank()}"))
            sched[0].record("sched", step=step, threads=priority.thread_times(), peak_rss=peak_rss_since_last())
            sched[0].flush()
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    metrics.MetricsProcessor.log = logged


NO_FINAL_SLEEP_ENV = "TITAN_CKPT_NO_FINAL_SLEEP"


class _TimeWithoutFinalSleep(types.ModuleType):
    """`time`, but sleep(2) lasts 0.25 s: see _skip_final_sleep."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(0.25 if seconds == 2 else seconds)  # a moment still: rank 0 hosts the store


def _skip_final_sleep() -> None:
    """Test hook, armed by TITAN_CKPT_NO_FINAL_SLEEP: torchtitan's train() ends with rank
    0 sleeping 2 s "for other ranks to complete" before the trainer closes, a sixth of
    a CPU test run; the e2e tests cut it to 0.25 s (the last step's save has flushed both
    tiers by then, and close() waits for whatever still runs). The trainer's module
    (__main__ under `torchrun -m torchtitan.train`) gets a `time` with that shorter sleep."""
    for mod in (sys.modules.get("__main__"), sys.modules.get("torchtitan.train")):
        if getattr(mod, "time", None) is time and hasattr(mod, "Trainer"):
            mod.time = _TimeWithoutFinalSleep("time")


_installed = False


def install() -> None:
    """Idempotent: CPU fallback (only without an accelerator), extra model flavors,
    and the CheckpointManager hook."""
    global _installed
    if _installed:
        return
    _installed = True
    cpu_fallback.apply_if_needed()
    flavors.register()
    _record_losses(os.environ.get(LOSS_LOG_ENV), os.environ.get(SCHED_LOG_ENV))
    if os.environ.get(NO_FINAL_SLEEP_ENV):
        _skip_final_sleep()

    def __new__(cls, *args, **kwargs):
        if cls is _StockManager and _wants_tiers(args, kwargs):
            cls = TieredCheckpointManager
        return object.__new__(cls)

    _StockManager.__new__ = __new__
    torchtitan_v022_data.install()  # dataloader resumption by global sample count
