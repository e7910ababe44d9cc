"""The training loop's bookkeeping, the same in every stage: what a run is (RunSetup), where it stands (RunState,
also after --resume) and where it ends, its clocks and the tokens timed, the log lines, the stop signals.

The stage's loop keeps in view the lines its lesson changes (the step, the evaluation, what a checkpoint holds)
and calls TrainingProgress around them: batches() and timed_step() for the step, log_due(), off_clock() and log()
for a log point, save_due(), saving() and state() for a checkpoint, pause() and finish().
"""

import contextlib
import dataclasses

import checkpoints
import failures
import gpu_memory
import inspection
import timekeeping
import utilization


@dataclasses.dataclass
class RunSetup:
    """What a run is: its settings (the command line, resolved), model config, device, tokenizer, wall clock and the
    checkpoint it continues (--resume; None: a new run); the tokens of one optimizer step (all processes'), the FLOPs
    per token MFU counts (in 03 the hardware's too, for HFU) and the peak FLOP/s they are measured against."""
    args: object
    config: dict
    device: object
    tokenizer: object
    wall_clock: timekeeping.WallClock
    resume: "checkpoints.Checkpoint | None"
    tokens_per_step: int
    flops_per_token: float
    peak_flops: "float | None"
    hardware_flops_per_token: "float | None" = None


@dataclasses.dataclass
class RunState:
    """Where a run stands: the epoch it is in (from 0), the optimizer steps and the epoch's batches done, and its
    history: the log (metrics.json's and the plot's), the tokens trained on, the tokens and seconds Avg tok/s
    counts, and the folder of a profile. A checkpoint keeps it as plain values (TrainingProgress.state())."""
    HISTORY = ("log", "tokens_seen", "timed_tokens", "timed_seconds")  # a checkpoint's "history" (and "steps")
    epoch: int = 0
    steps: int = 0
    batches_done: int = 0
    log: list = dataclasses.field(default_factory=list)
    tokens_seen: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    profile: "str | None" = None

    def avg_tok_per_sec(self):
        """Tokens per second over every log interval but the first (None before the second)."""
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else None


class TrainingProgress:
    """One training run's books. `step` is the last optimizer step done (0-based, as in the log; -1 before the
    first), `done` whether it was the run's last; `now` is where the run stands (RunState)."""

    def __init__(self, setup, steps_per_epoch):
        args = self.args = setup.args
        self.setup, self.wall_clock, self.steps_per_epoch = setup, setup.wall_clock, steps_per_epoch
        resume = setup.resume  # where the checkpoint's run stood, or a new run's start
        self.now = RunState(resume["epoch"], resume["step"], resume["batches_done"],
                            *(resume["history"][key] for key in RunState.HISTORY)) if resume else RunState()
        self.start_epoch, self.skip_batches = self.now.epoch, self.now.batches_done
        self.clock = timekeeping.TrainClock(setup.device)
        self.stop = checkpoints.StopSignal()  # Ctrl-C, SIGTERM or SIGHUP: finish the step, save, exit
        self.stop_signum, self.interval_tokens, self.first_interval, self.done = 0, 0, True, False
        self.total_steps = min(args.epochs * steps_per_epoch, args.max_steps or float("inf"))
        if self.now.steps >= self.total_steps:  # resumed at or past the limit: never train beyond it
            raise failures.NothingToTrain(
                f"the checkpoint has done {self.now.steps} steps, and this run ends after {self.total_steps} "
                f"(--epochs {args.epochs}, --max-steps {args.max_steps}); raise --epochs or --max-steps to train "
                "on. No file was changed.")
        self.inspector = inspection.RunInspection(args, setup.device, self.now.steps, self.total_steps,  # --profile,
                                                  steps_per_epoch)  # --memory-snapshot

    @property
    def step(self):
        return self.now.steps - 1

    def batches(self, loader, epoch):
        """The epoch's batches, less those a resumed run trained before its checkpoint; the clock starts."""
        self.now.epoch = epoch
        batches = iter(loader)
        self.now.batches_done = self.skip_batches if epoch == self.start_epoch else 0
        for _ in range(self.now.batches_done):
            next(batches)
        self.clock.start()
        return batches

    @contextlib.contextmanager
    def timed_step(self):
        """One optimizer step on the training clock (a profiled step is slower: off it), then counted."""
        if self.wall_clock.phase_now != "training":
            self.wall_clock.enter("training", lambda: f"training: epoch {self.now.epoch + 1}, step {self.now.steps}")
        off_clock = self.inspector.off_clock(self.step + 1)
        if off_clock:
            self.clock.stop(wait=False)  # the events count queued kernels: let the GPU run on
        yield
        self.now.steps += 1
        self.inspector.step_done(self.step)
        if off_clock:
            self.clock.start()
        self.now.batches_done += 1
        self.interval_tokens += 0 if off_clock else self.setup.tokens_per_step
        self.now.tokens_seen += self.setup.tokens_per_step
        self.done = self.step + 1 >= self.total_steps

    def log_due(self):
        """Every --eval-freq steps, and after the last."""
        return self.step % self.args.eval_freq == 0 or self.done

    def pause(self, phase):
        """Stop the training clock for work that is not training: the wall clock's `phase` ("sampling"). Nothing
        restarts it by name: the next epoch's `batches` does, or off_clock at the end of its block."""
        self.clock.stop()
        self.wall_clock.enter(phase)

    @contextlib.contextmanager
    def off_clock(self, phase):
        """The clock stopped while the block runs (evaluation and its log line), then on again."""
        self.pause(phase)
        yield
        self.clock.start()

    def log(self, train_loss, val_loss):
        """The log line and its history entry. Step tok/s counts the interval since the previous line; Avg tok/s
        every interval but the first, which holds the warm-up. Where the hardware's FLOPs differ from the model's
        (03's recomputed blocks), the line adds HFU; 03's entries always have it. The first call also ends the warm-up
        for the memory figures: on CUDA it empties the allocator's cache and resets its peaks (gpu_memory)."""
        seconds = self.clock.take()
        interval_tokens, now, setup = self.interval_tokens, self.now, self.setup
        step_tok_per_sec = interval_tokens / seconds if interval_tokens else None  # None: all profiled
        if not self.first_interval:  # the first interval holds the warm-up: left out of the average
            now.timed_tokens += interval_tokens
            now.timed_seconds += seconds
        avg_tok_per_sec = now.avg_tok_per_sec()
        mfu = utilization.mfu(step_tok_per_sec, setup.flops_per_token, setup.peak_flops)
        hfu = (mfu if setup.hardware_flops_per_token is None
               else utilization.mfu(step_tok_per_sec, setup.hardware_flops_per_token, setup.peak_flops))
        print(f"Ep {now.epoch + 1}, Step {self.step:06d}, Train: {train_loss:.3f}, Val: {val_loss:.3f}, "
              f"Step tok/sec: {round(step_tok_per_sec) if step_tok_per_sec else 'n/a'}, Avg tok/sec: "
              + (f"{round(avg_tok_per_sec)}" if avg_tok_per_sec else "n/a")
              + (f", MFU: {100 * mfu:.1f}%" if mfu is not None else "")
              + (f", HFU: {100 * hfu:.1f}%" if hfu != mfu else ""), flush=True)
        now.log.append({
            "epoch": now.epoch + 1, "step": self.step, "train_loss": train_loss, "val_loss": val_loss,
            "step_tok_per_sec": step_tok_per_sec, "avg_tok_per_sec": avg_tok_per_sec, "mfu": mfu,
            "tokens_seen": now.tokens_seen, "epochs_seen": now.steps / self.steps_per_epoch,
            "timed_tokens": interval_tokens,
            **({} if setup.hardware_flops_per_token is None else {"hfu": hfu}),  # MFU with a recomputed forward counted
        })
        if self.first_interval:
            gpu_memory.end_of_warm_up(self.setup.device)  # the steady state's memory peaks count from here
        self.interval_tokens, self.first_interval = 0, False

    def save_due(self):
        """Every --save-every steps, after the last, and once a stop signal came. Call it after every step: in a
        distributed run the ranks agree on the signal there (checkpoints.StopSignal)."""
        self.stop_signum = self.stop.requested()
        return bool(self.done or self.stop_signum
                    or (self.args.save_every and (self.step + 1) % self.args.save_every == 0))

    @contextlib.contextmanager
    def saving(self):
        """The checkpoint is written off the clock; after a stop signal the run then ends (failures.Interrupted)."""
        self.clock.stop()
        yield
        if self.stop_signum:
            raise failures.Interrupted(self.stop_signum, self.step)
        if not self.done:  # a --save-every checkpoint (the last one is named by the run's final lines)
            print(f"Saved {self.args.out}/model.pth after step {self.step:06d} (--save-every {self.args.save_every})",
                  flush=True)
        self.clock.start()

    def state(self):
        """What --resume needs of the loop: where the run is, its history, the random state. "step" counts the steps
        done, one more than the index of the last (`self.step`, the log's `Step`)."""
        now, history = self.now, {"steps": self.now.steps, **{key: getattr(self.now, key) for key in RunState.HISTORY}}
        return {"epoch": now.epoch, "batches_done": now.batches_done, "step": now.steps, "history": history,
                "rng": checkpoints.rng_state(self.setup.device)}

    def finish(self):
        """At the end of training: where the run stands, with the profile's folder (if one was taken)."""
        failures.training_over = True  # the final checkpoint is written: a failed output write cannot be resumed
        self.now.profile = self.inspector.finish()
        return self.now
