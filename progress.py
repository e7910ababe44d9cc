"""The training loop's bookkeeping, the same in every stage: where the run is (also after --resume) and where it
ends, the training clock and the tokens it timed, the log lines with their history, and the stop signals.

The stage's loop keeps in view the lines its lesson changes (the step, the evaluation, what a checkpoint holds)
and calls TrainingProgress around them: batches() and timed_step() for the step, log_due(), off_clock() and log()
for a log point, save_due(), saving() and state() for a checkpoint, pause() and finish().
"""

import contextlib

import checkpoints
import failures
import gpu_memory
import inspection
import timekeeping
import utilization


class TrainingProgress:
    """One training run's books. `step` is the last optimizer step done (0-based, as in the log; -1 before the
    first), `done` whether it was the run's last; `history` becomes metrics.json's log and the plot."""

    def __init__(self, args, device, speed, heartbeat, steps_per_epoch, resume=None):
        self.device, self.speed, self.heartbeat = device, speed, heartbeat
        self.eval_freq, self.save_every, self.steps_per_epoch = args.eval_freq, args.save_every, steps_per_epoch
        self.history = {"log": [], "tokens_seen": 0, "steps": 0, "timed_tokens": 0, "timed_seconds": 0.0}
        self.start_epoch, self.step, self.skip_batches = 0, -1, 0
        if resume:
            self.history, self.start_epoch, self.step, self.skip_batches = (
                resume["history"], resume["epoch"], resume["step"] - 1, resume["batches_done"])
        self.clock = timekeeping.TrainClock(device)
        self.stop = checkpoints.StopSignal()  # Ctrl-C, SIGTERM or SIGHUP: finish the step, save, exit
        self.stop_signum = 0
        self.interval_tokens, self.first_interval, self.done = 0, True, False
        self.epoch = self.batches_done = None
        self.total_steps = min(args.epochs * steps_per_epoch, args.max_steps or float("inf"))
        if self.history["steps"] >= self.total_steps:  # resumed at or past the limit: never train beyond it
            raise failures.NothingToTrain(
                f"the checkpoint has done {self.history['steps']} steps, and this run ends after {self.total_steps} "
                f"(--epochs {args.epochs}, --max-steps {args.max_steps}); raise --epochs or --max-steps to train "
                "on. No file was changed.")
        self.inspector = inspection.RunInspection(args, device, self.step + 1, self.total_steps,  # --profile,
                                                  steps_per_epoch)  # --memory-snapshot

    def batches(self, loader, epoch):
        """The epoch's batches, less those a resumed run trained before its checkpoint; the clock starts."""
        self.epoch = epoch
        batches = iter(loader)
        self.batches_done = self.skip_batches if epoch == self.start_epoch else 0
        for _ in range(self.batches_done):
            next(batches)
        self.clock.start()
        return batches

    @contextlib.contextmanager
    def timed_step(self):
        """One optimizer step on the training clock (a profiled step is slower: off it), then counted."""
        self.heartbeat.doing = f"training: epoch {self.epoch + 1}, step {self.step + 1}"
        off_clock = self.inspector.off_clock(self.step + 1)
        if off_clock:
            self.clock.stop(wait=False)  # the events count queued kernels: let the GPU run on
        yield
        self.step += 1
        self.inspector.step_done(self.step)
        if off_clock:
            self.clock.start()
        self.batches_done += 1
        tokens_per_step = self.speed["tokens_per_step"]
        self.interval_tokens += 0 if off_clock else tokens_per_step
        self.history["tokens_seen"] += tokens_per_step
        self.done = self.step + 1 >= self.total_steps

    def log_due(self):
        """Every --eval-freq steps, and after the last."""
        return self.step % self.eval_freq == 0 or self.done

    def pause(self, doing=None):
        """Stop the training clock for work that is not training; `doing` tells the heartbeat what it is."""
        self.clock.stop()
        if doing is not None:
            self.heartbeat.doing = doing

    @contextlib.contextmanager
    def off_clock(self, doing=None):
        """The clock stopped while the block runs (evaluation, the log line, a checkpoint), then on again."""
        self.pause(doing)
        yield
        self.clock.start()

    def log(self, train_loss, val_loss, hardware_flops_per_token=None):
        """The log line and its history entry. Step tok/s counts the interval since the previous line; Avg tok/s
        every interval but the first, which holds the warm-up. With `hardware_flops_per_token` (03) the line adds
        HFU where it differs from MFU, and the entry has it too."""
        seconds = self.clock.take()
        interval_tokens, history = self.interval_tokens, self.history
        step_tok_per_sec = interval_tokens / seconds if interval_tokens else None  # None: all profiled
        if not self.first_interval:  # the first interval holds the warm-up: left out of the average
            history["timed_tokens"] += interval_tokens
            history["timed_seconds"] += seconds
        avg_tok_per_sec = history["timed_tokens"] / history["timed_seconds"] if history["timed_seconds"] else None
        mfu = utilization.mfu(step_tok_per_sec, self.speed["flops_per_token"], self.speed["peak_flops"])
        hfu = (mfu if hardware_flops_per_token is None
               else utilization.mfu(step_tok_per_sec, hardware_flops_per_token, self.speed["peak_flops"]))
        print(f"Ep {self.epoch + 1}, Step {self.step:06d}, Train: {train_loss:.3f}, Val: {val_loss:.3f}, "
              f"Step tok/sec: {round(step_tok_per_sec) if step_tok_per_sec else 'n/a'}, Avg tok/sec: "
              + (f"{round(avg_tok_per_sec)}" if avg_tok_per_sec else "n/a")
              + (f", MFU: {100 * mfu:.1f}%" if mfu is not None else "")
              + (f", HFU: {100 * hfu:.1f}%" if hfu != mfu else ""), flush=True)
        history["log"].append({
            "epoch": self.epoch + 1, "step": self.step, "train_loss": train_loss, "val_loss": val_loss,
            "step_tok_per_sec": step_tok_per_sec, "avg_tok_per_sec": avg_tok_per_sec, "mfu": mfu,
            "tokens_seen": history["tokens_seen"], "epochs_seen": (self.step + 1) / self.steps_per_epoch,
            "timed_tokens": interval_tokens,
            **({} if hardware_flops_per_token is None else {"hfu": hfu}),  # MFU with a recomputed forward counted
        })
        if self.first_interval:
            gpu_memory.end_of_warm_up(self.device)  # the steady state's memory peaks count from here
        self.interval_tokens, self.first_interval = 0, False

    def save_due(self):
        """Every --save-every steps, after the last, and once a stop signal came. Call it after every step: in a
        distributed run the ranks agree on the signal there (checkpoints.StopSignal)."""
        self.stop_signum = self.stop.requested()
        return bool(self.done or self.stop_signum
                    or (self.save_every and (self.step + 1) % self.save_every == 0))

    @contextlib.contextmanager
    def saving(self):
        """The checkpoint is written off the clock; after a stop signal the run then ends (failures.Interrupted)."""
        self.clock.stop()
        yield
        if self.stop_signum:
            raise failures.Interrupted(self.stop_signum, self.step)
        self.clock.start()

    def state(self):
        """What --resume needs of the loop: where the run is, its history, the random state."""
        self.history["steps"] = self.step + 1
        return {"epoch": self.epoch, "batches_done": self.batches_done, "step": self.step + 1,
                "history": self.history, "rng": checkpoints.rng_state(self.device)}

    def finish(self):
        """At the end of training: the history, with the profile's folder (if one was taken)."""
        self.history["steps"] = self.step + 1
        self.history["profile"] = self.inspector.finish()
        return self.history
