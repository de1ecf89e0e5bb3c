"""The RL recipe, top to bottom: `setup`, `train`, `cleanup`.

It runs any objective (`actor.objective`) on any task (`data.task`), knowing neither by name.
One RL step: the task's train rows, repeat each ``rollout.n`` times under one ``uid``, generate
and score them through the `AgentLoopManager` (streaming rewards), compute group-relative
advantages, update the actor on the stored trajectories, and sync the new weights to the
rollout replicas (`flowloop.trainer.placement.WorkerGroup`: one process, or Ray ranks and
replicas); every request names the weight version it must be sampled with (``rollout.max_staleness``
> 0: the next step's rows sample during this step's update, `flowloop.trainer.pipeline`). Validation
runs before training, every ``trainer.val_every`` steps and at the end (the task's validation rows,
scored by the task); checkpoints every ``trainer.save_every`` steps, at the end, on Ctrl-C or
SIGTERM, and before a step that failed before its update (a reward that failed) stops the run. One
process trains into a run folder at a time (`flowloop.trainer.run_folder`); its ``config.yaml`` is
written once set-up has succeeded.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from flowloop.agent_loop import AgentLoopManager
from flowloop.config import to_yaml
from flowloop.config.train import TrainConfig
from flowloop.protocol import Batch
from flowloop.tasks import Task, build_task
from flowloop.trainer.advantages import PerPromptStatTracker, compute_advantages
from flowloop.trainer.checkpoint import (
    capture_rng_state, describe_weights, load_checkpoint, new_run_dir, resolve_resume, restore_rng_state, save_checkpoint,
)
from flowloop.trainer.config_check import check_sampling
from flowloop.trainer.evaluate import to_uint8_images, with_rewards
from flowloop.trainer.losses import NonFiniteGuard, NonFiniteLossError
from flowloop.trainer.metrics_log import METRICS_FILE, MetricsLogger, ProgressLine
from flowloop.trainer.pipeline import RolloutPipeline
from flowloop.trainer.placement import WorkerGroup
from flowloop.trainer.run_folder import RunLock, check_resume_config, clean_stale_temporaries
from flowloop.trainer.sharding import nonfinite
from flowloop.trainer.step_metrics import category_reward_means, reward_extra_means
from flowloop.trainer.stop import StopRequest
from flowloop.visual import save_grid

logger = logging.getLogger(__name__)


class RLRecipe:
    """``recipe = RLRecipe(cfg); recipe.setup(); summary = recipe.train(); recipe.cleanup()``."""

    def __init__(self, cfg: TrainConfig, log=print):
        cfg.validate()
        check_sampling(cfg.rollout)
        self.cfg = cfg
        self.log = log
        self.start_step = 0
        self.version = 0
        self.updating: int | None = None
        """The step whose update is running (None between updates)."""
        """The update count behind the replicas' weights; a step's rows must be sampled with it."""
        self.history: list[dict] = []
        self.task: Task = build_task(cfg)
        """Train rows, validation rows and their scoring (`flowloop.tasks`)."""
        self.val_metric = self.task.val_metric
        """The validation figure the progress line and the summary report."""

    # -- setup --------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        # 1. Run folder, locked against a second process: resume into it, or a new one.
        checkpoint, created = self._open_run_dir()
        try:
            self._build(checkpoint)
        except BaseException:
            self.lock.release()
            if created:  # a start that failed leaves no folder behind
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        # 4. The run's record changes only once everything above worked.
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.log(f"run folder: {self.run_dir}" + (f" (resumed at step {self.start_step})" if checkpoint else ""))

    def _open_run_dir(self) -> tuple[Path | None, bool]:
        """Lock the run folder and find the checkpoint to resume from (None: start at step 0);
        also says whether the folder was made here. ``resume=auto`` on a folder without a
        checkpoint starts it over in place."""
        trainer = self.cfg.trainer
        named = Path(trainer.run_root) / trainer.run_name
        checkpoint, created = None, False
        if trainer.resume == "never":
            self.run_dir, created = new_run_dir(trainer.run_root, trainer.run_name), True
        elif trainer.resume == "auto":
            created = not named.exists()
            self.run_dir = new_run_dir(trainer.run_root, trainer.run_name) if created else named
        else:
            checkpoint = resolve_resume(named, trainer.resume)
            self.run_dir = Path(checkpoint).parent.parent
        self.lock = RunLock(self.run_dir).acquire()
        try:
            clean_stale_temporaries(self.run_dir)
            if trainer.resume == "auto" and not created:
                checkpoint = resolve_resume(self.run_dir, "auto")
                if checkpoint is None and (self.run_dir / METRICS_FILE).exists():
                    self.log(f"{self.run_dir} has no checkpoint: starting it over from step 0")
                    (self.run_dir / METRICS_FILE).unlink()
            if checkpoint is not None:
                self.resume_changes = check_resume_config(self.run_dir, self.cfg, self.log)
        except BaseException:
            self.lock.release()
            raise
        return checkpoint, created

    def _build(self, checkpoint: Path | None) -> None:
        cfg = self.cfg
        # 2. Trainer ranks and rollout replicas (one local worker, or Ray actors), agent loops, rewards.
        try:
            self.group = WorkerGroup.create(cfg)
        except Exception as err:
            if type(err).__name__ != "SafetensorError":
                raise
            raise ValueError(f"model.path={cfg.model.path}: a weights file cannot be read ({err}): it looks truncated "
                             "or corrupt; copy the model folder again") from err
        local = self.group.local_worker
        model = local.model if local is not None else SimpleNamespace(**self.group.describe())
        self.manager = AgentLoopManager.create(cfg.rollout, model, mode=cfg.scale.mode, replicas=self.group.replicas)
        self.rollouts = RolloutPipeline(self.manager, self.make_batch, cfg.rollout.max_staleness)
        self.tracker = PerPromptStatTracker() if cfg.advantage.estimator == "per_prompt" else None
        self.guard = NonFiniteGuard()
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        # 3. Resume: weights, optimizer, scheduler, RNG, trackers, history.
        if checkpoint is not None:
            self._restore(checkpoint)
        self.version = self.start_step
        self.saved_step = self.start_step if checkpoint is not None else None
        self.group.sync_weights(self.manager, self.version)
        self.metrics_log = MetricsLogger(self.run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb,
                                         resume_step=self.start_step if checkpoint is not None else None)

    # -- train --------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg.trainer
        progress = ProgressLine(cfg.total_steps, start_step=self.start_step)
        if self.start_step == 0:
            self.before = self.validate(0)
            self.metrics_log.log(0, self.before)
            progress.update(0, accuracy=self.before[self.val_metric])
        step = self.start_step
        with StopRequest(self.log) as stop:
            for step in range(self.start_step + 1, cfg.total_steps + 1):
                before = self._state_before_step()
                try:
                    metrics = self.train_step(step)
                except Exception:  # e.g. a failed reward: keep the finished steps
                    self.rollouts.cancel()
                    self._save_unsaved(step - 1, before)
                    progress.close()
                    raise
                if step % cfg.val_every == 0 or step == cfg.total_steps:
                    metrics.update(self.validate(step))
                self.metrics_log.log(step, metrics)
                self.history.append({"step": step, **{k: v for k, v in metrics.items() if k.startswith("val/")}})
                progress.update(step, metrics["reward/mean"], metrics.get(self.val_metric), metrics["time/step"])
                try:
                    if self.updated:  # a step whose groups were all dropped made no update to judge
                        self.guard.record(metrics.get("actor/skipped_nonfinite", 0), step)
                except NonFiniteLossError:
                    self.guard.consecutive = 0  # a resumed run (at a lower lr) gets the full allowance again
                    self.save(step)  # skipped steps left the weights finite; save() checks
                    progress.close()
                    self.log(f"stopped: non-finite loss {self.guard.max_consecutive} steps in a row; checkpoint of step {step} "
                             f"in {self.run_dir / 'checkpoints'}. Resume with trainer.resume=auto and a lower actor.lr.")
                    raise
                if step % cfg.save_every == 0 or step == cfg.total_steps or stop.requested:
                    self.save(step)
                if stop.requested:
                    progress.close()
                    self.log(f"\nstopped by {stop.signal_name}: checkpoint of step {step} in {self.run_dir / 'checkpoints'}; "
                             f"resume with\n  flowloop train trainer.resume=auto trainer.run_root={cfg.run_root} "
                             f"trainer.run_name={self.run_dir.name} (plus the overrides this run used)")
                    raise KeyboardInterrupt
        progress.close()
        return self.summary()

    def train_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        # 1-2. This step's prompts (`make_batch`), generated and scored (rewards stream): now, or during the last update.
        out = self.rollouts.take(step)
        generated = time.perf_counter()
        rewards = out["rm_scores"][:, 0]  # [B]
        # 3. Advantages over each uid's group.
        metrics, options = {}, {}
        if self.tracker is not None:
            options = {"tracker": self.tracker, "prompts": list(out["raw_prompt"])}
        result = compute_advantages(self.cfg.advantage.estimator, rewards, out["uid"],
                                    drop_zero_std_groups=self.cfg.advantage.drop_zero_std_groups, **options)
        keep = result.keep.nonzero().flatten()
        self.updated = bool(len(keep))
        # 4. Async mode: the next step's rows sample with the replicas' weights (this version) meanwhile.
        if step < self.cfg.trainer.total_steps:
            self.rollouts.start(step + 1)
        # 5. Update the actor on the kept rows; 6. once the next step's rows are done, the replicas
        #    sample with the new weights.
        if len(keep):
            self.updating = step  # from here a failure may leave the weights part-way through this update
            metrics.update(self.group.update(out[keep.tolist()], result.advantages[keep], self.generator))
            self.updating = None
        updated = time.perf_counter()
        self.rollouts.wait()
        waited = time.perf_counter()
        if "weight_version" in out:
            metrics["rollout/weight_version"] = float(out["weight_version"].min())
            if self.cfg.rollout.max_staleness > 0:  # updates between the rows' weights and the ones they train
                metrics["rollout/staleness"] = float(self.version - out["weight_version"].min())
        self.version = step
        self.group.sync_weights(self.manager, self.version)
        end = time.perf_counter()
        metrics.update({
            **reward_extra_means(out),
            **category_reward_means(out, rewards),
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
            **{f"advantage/{k}": float(v) for k, v in result.stats.items()},
            "time/generate": generated - start + waited - updated, "time/update": updated - generated, "time/weight_sync": end - waited,
            "time/step": end - start,
            "throughput/samples_per_s": len(out) / (end - start),
            **{f"time/{k}": v for k, v in out.meta_info.get("timing", {}).items()},
        })
        return metrics

    def make_batch(self, step: int) -> Batch:
        """The task's ``prompts_per_step`` train rows of this step (from seed and step alone, so
        resume is exact), each repeated ``rollout.n`` times under one uid."""
        chosen = self.task.train_rows(self.cfg.trainer.seed, step, self.cfg.data.prompts_per_step)
        return group_batch(chosen, step, self.cfg.rollout.n, self.cfg.data.negative_prompt, self.version)

    # -- validation ---------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, float]:
        """The task's validation rows with ``val_kwargs`` (ODE, fixed seeds) under the EMA weights
        when there are any, scored by the task; the grid goes to ``grids/step_<step>.png``."""
        rows = self.task.val_rows()
        start = time.perf_counter()
        batch = prompt_batch(rows, [f"val-{i}" for i in range(len(rows))], self.cfg.data.negative_prompt,
                             {"validate": True, "weight_version": self.version})
        with self.group.ema_weights():
            out = self.manager.generate_sequences(batch)
        responses = out["responses"]  # [V, C, H, W] or video [V, T, C, H, W]: the task sees first frames
        images = to_uint8_images(responses[:, 0] if responses.ndim == 5 else responses)
        metrics, grid = self.task.evaluate(images, with_rewards(rows, out))
        path = save_grid(grid.images, grid.captions, self.run_dir / "grids" / f"step_{step:06d}.png", per_prompt=grid.per_row)
        self.metrics_log.log_image(step, "val/grid", path)  # TensorBoard and wandb, when on
        metrics["time/validate"] = time.perf_counter() - start
        self.log(f"step {step}: {self.val_metric} {metrics[self.val_metric]:.4f} over {len(rows)} samples; grid {path}")
        return metrics

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, step: int, before: dict | None = None) -> Path:
        """Checkpoint ``step``; ``before``: the RNG states as the next step began (`_state_before_step`),
        when that step has run part way. Non-finite weights are never saved (NonFiniteLossError)."""
        extra = {"guard": self.guard.state_dict(), "history": json.dumps(self.history), "before": json.dumps(getattr(self, "before", {}))}
        if self.tracker is not None:
            extra["tracker"] = self.tracker.state_dict()
        sharded = self.group.sharded  # then each rank writes its shards (dcp/), else rank 0 the whole
        trained = self.group.checkpoint_state(gather=not sharded)  # either loads on any number of ranks
        self._refuse_nonfinite(step, [] if sharded else nonfinite(trained["model"]))
        if trained["ema"] is not None:
            extra["ema"] = trained["ema"]
        state = dict(before) if before is not None else self._state_before_step()
        path = save_checkpoint(self.run_dir, step, trained["model"], trained["optimizer"], [trained["scheduler"]],
                               state, {"step": step}, extra, keep_last=self.cfg.trainer.keep_last,
                               description=describe_weights(self.cfg.model, self.cfg.actor),
                               shards=(lambda f: self._refuse_nonfinite(step, self.group.save_shards(f))) if sharded else None)
        self.saved_step = step
        return path

    def _refuse_nonfinite(self, step: int, bad: list[str]) -> None:
        if bad:
            last = "none" if self.saved_step is None else f"step {self.saved_step}"
            raise NonFiniteLossError(f"the weights of step {step} are not finite ({len(bad)} tensors, e.g. {bad[0]}): not "
                                     f"saved; the last finite checkpoint ({last}) is in {self.run_dir / 'checkpoints'}")

    def _state_before_step(self) -> dict:
        state = capture_rng_state()
        state["trainer_generator"] = self.generator.get_state()
        return state

    def _save_unsaved(self, step: int, before: dict) -> None:
        """After a step failed before its update (the weights are still those of ``step``),
        checkpoint ``step`` unless it is saved already, so a resume loses nothing. A failure inside
        the update (some optimizer steps may have run) saves nothing: the last checkpoint stands."""
        if self.version != step or step <= 0 or self.saved_step == step or self.updating == step + 1:
            return
        try:
            path = self.save(step, before)
        except Exception as err:  # the step's own error is the one to report
            self.log(f"could not checkpoint step {step} after the failure: {err}")
            return
        self.log(f"step {step + 1} failed; checkpoint of step {step} in {path}; fix the cause and resume with trainer.resume=auto")

    def _restore(self, checkpoint: Path) -> None:
        loaded = load_checkpoint(checkpoint)
        state = train_state(loaded)
        state["changes"] = getattr(self, "resume_changes", {})  # each rank puts them into its optimizer state
        self.group.load_checkpoint_state(state)
        rng = dict(loaded.rng_state)
        self.generator.set_state(rng.pop("trainer_generator"))
        restore_rng_state(rng)
        self.guard.load_state_dict(loaded.extra["guard"])
        if self.tracker is not None:
            self.tracker.load_state_dict(loaded.extra["tracker"])
        self.history = json.loads(loaded.extra["history"])
        self.before = json.loads(loaded.extra["before"])
        self.start_step = loaded.step

    # -- summary and cleanup ------------------------------------------------------------
    def summary(self) -> dict:
        after = next((h for h in reversed(self.history) if self.val_metric in h), {})
        summary = {
            "run_dir": str(self.run_dir),
            "steps": self.cfg.trainer.total_steps,
            "val_metric": self.val_metric,
            "before": self.before.get(self.val_metric),
            "after": after.get(self.val_metric),
            "grid_before": str(self.run_dir / "grids" / "step_000000.png"),
            "grid_after": str(self.run_dir / "grids" / f"step_{after.get('step', 0):06d}.png"),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def cleanup(self) -> None:
        if hasattr(self, "manager"):
            self.manager.shutdown()
        if hasattr(self, "group"):
            self.group.shutdown()
        if hasattr(self, "metrics_log"):
            self.metrics_log.close()
        if hasattr(self, "lock"):
            self.lock.release()


def group_batch(rows: list[dict], step: int, n: int, negative_prompt: str | None, weight_version: int) -> Batch:
    """One training step's ``rows``, each repeated ``n`` times under one uid (a GRPO group)."""
    uids = [f"{step}-{g}" for g in range(len(rows)) for _ in range(n)]
    return prompt_batch([row for row in rows for _ in range(n)], uids, negative_prompt,
                        {"global_steps": step, "weight_version": weight_version})


def prompt_batch(rows: list[dict], uids: list[str], negative_prompt: str | None, meta_info: dict) -> Batch:
    """Rows -> a Batch with ``raw_prompt``, ``uid``, every extra field of the rows (a prompt
    file's columns, which rewards receive), and ``negative_prompt`` when one is set."""
    columns = {"raw_prompt": [r["raw_prompt"] for r in rows], "uid": uids}
    for key in dict.fromkeys(k for r in rows for k in r if k != "raw_prompt"):
        columns[key] = [r.get(key) for r in rows]
    if negative_prompt is not None:
        columns["negative_prompt"] = [negative_prompt] * len(rows)
    return Batch.from_dict(non_tensors=columns, meta_info=meta_info)


def train_state(loaded) -> dict:
    """A loaded checkpoint's weights, optimizer, schedule and EMA, as `Actor.load_full_state` takes
    them; a sharded checkpoint's weights and optimizer state stay in its ``shards`` folder."""
    if (loaded.optimizer_state is None and loaded.shards is None) or not loaded.scheduler_states:
        raise ValueError(f"{loaded.path} has no optimizer or schedule state to resume from")
    return {"model": loaded.model_state, "optimizer": loaded.optimizer_state, "shards": loaded.shards and str(loaded.shards),
            "scheduler": loaded.scheduler_states[0], "ema": loaded.extra.get("ema")}


def run(cfg: TrainConfig, log=print) -> dict:
    """Set up, train and clean up; returns the summary."""
    recipe = RLRecipe(cfg, log)
    try:
        recipe.setup()
        return recipe.train()
    finally:
        recipe.cleanup()


__all__ = ["RLRecipe", "run"]
