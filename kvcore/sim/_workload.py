"""Simulator options and request generation: one seed drives everything.

Fault rates are drawn per seed (unless given), as the VOPR does, so a fleet of seeds
covers calm runs and stormy ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace

from kvcore.spec.errors import ConfigError
from kvcore.spec.types import MAX_CONTEXT_TOKENS, OffloadConfig

# Bounds of the counts (field: low, high). Each is far above a useful run; a value past
# one is a typo that would otherwise hang generating prompts or burn max_steps idle.
_COUNTS = {"seed": (0, (1 << 64) - 1), "requests": (0, 100_000),
           "context_tokens": (1, MAX_CONTEXT_TOKENS), "max_new_tokens": (1, MAX_CONTEXT_TOKENS),
           "prefill_budget": (1, MAX_CONTEXT_TOKENS), "max_running": (1, 100_000),
           "spec_tokens": (0, 64), "layers": (1, 1024), "row_elems": (1, 1 << 20),
           "max_steps": (1, 10**9)}
# Shares in [0, 1]; None (where allowed) is drawn per seed. A preemption every step (1)
# would never let a run settle.
_RATES = ("accept_rate", "shared_prefix_rate", "aligned_prompt_rate", "follow_up_rate",
          "fail_rate", "delay_rate", "abort_rate", "reset_rate", "preempt_rate",
          "events_rate", "request_cap_rate", "gpu_cache_rate", "lookup_cap_rate",
          "skip_reading_rate", "step_hashes_rate", "stream_fault_rate")
_FLAGS = ("prompt_only", "speculative_off", "own_step_type", "keys_only_tier",
          "simulate_stream", "lockstep", "hostile")


@dataclass(frozen=True)
class SimOptions:
    """Everything a run depends on besides the layout. ``None`` rates are drawn per seed."""

    seed: int = 0
    requests: int = 8
    context_tokens: int = 512
    max_new_tokens: int = 24
    prefill_budget: int = 256
    max_running: int = 4
    spec_tokens: int = 2
    accept_rate: float = 0.7
    shared_prefix_rate: float = 0.6
    # Share of prompts whose length is a whole number of the layout's largest chunk
    # (a boundary at the prompt's end itself, where the N - 1 limit of window groups
    # decides the hit); other prompts end anywhere.
    aligned_prompt_rate: float = 0.0
    follow_up_rate: float = 0.3
    fail_rate: float | None = None
    delay_rate: float | None = None
    abort_rate: float | None = None
    reset_rate: float | None = None
    # Each step, the chance that one running request is preempted (as memory pressure
    # would, on any pool size); it resumes later with its whole table re-sent.
    preempt_rate: float = 0.0
    # Each step, the chance that the engine drains the tier's events (``take_events``, as
    # one publishing KV events does); with checks on they are compared with the
    # reference's. ``max_pending_events`` overrides the config's buffer (small: drops).
    events_rate: float = 0.0
    max_pending_events: int | None = None
    num_workers: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    # The tier's eviction policy ("lru" or "arc"); None: drawn per seed.
    policy: str | None = None
    # Config variants that make the storable prefix U fall below the frontier V: store
    # prompt tokens only; cap every request's stored tokens; cap a share of requests
    # (RequestInfo.max_offload_tokens) at a drawn fraction of their prompt.
    prompt_only: bool = False
    max_offload_tokens: int | None = None
    request_cap_rate: float = 0.0
    # Serve the layout with speculative decoding off, as an engine running the same model
    # without its EAGLE/MTP drafter does: the draft groups are dropped (no-op for a
    # layout without them, or of draft groups only). Then the N - 1 limit, not the draft
    # group's extra chunk, keeps a prompt's last chunk from being a hit.
    speculative_off: bool = False
    # Describe each step with an engine's own subclass of ScheduledRequest. kvcore's C
    # pass vouches only for its own exact types, so every step then takes the Python path
    # (its checks, the blocks applied, the stores), which kvcore's own type never reaches.
    own_step_type: bool = False
    # Serve the scheduler from a tier with only the base interface (``KeysOnlyTier``: no
    # hash batches), as an engine's own tier may be; with checks on only (it shadows).
    keys_only_tier: bool = False
    # Share of admissions whose first tokens the engine's GPU prefix cache already holds
    # (the lookup's computed_tokens > 0).
    gpu_cache_rate: float = 0.0
    # Share of admission lookups that pass a cap (``max_tokens``, drawn from 0 to the
    # uncached rest of the prompt), as an engine limiting one step's load does.
    lookup_cap_rate: float = 0.0
    # Share of requests that must not load from the tier (``RequestInfo.skip_reading``,
    # e.g. vLLM's ``skip_reading_prefix_cache``): their lookups answer 0; they store.
    skip_reading_rate: float = 0.0
    # Share of requests whose hashes of sampled tokens go in their next step's
    # ``ScheduledRequest.new_hashes`` (an engine hashing in its scheduler step) instead
    # of ``add_hashes``.
    step_hashes_rate: float = 0.0
    # Copy through the transfer engine's stand-in stream (CPU only): jobs retire by
    # their events and their bytes land late, as on a GPU (``simulate_stream``).
    simulate_stream: bool = False
    # Share of jobs whose copy the stand-in stream fails while it runs it (a device
    # error, before or after the bytes land; ``simulate_faults``). Needs simulate_stream.
    stream_fault_rate: float = 0.0
    layers: int = 2
    row_elems: int = 4
    max_steps: int = 20_000
    # Run the scheduler in lock step with the reference model (R1; LRU only, since the
    # reference tier is LRU). Slower: the reference recomputes everything on each hook.
    lockstep: bool = False
    # Before a share of the hook calls, make a bad twin of the call that must bounce (A1).
    hostile: bool = False

    def __post_init__(self) -> None:
        """Every field's type and range, before anything runs: a string count failed deep
        in a run, a NaN rate ran as if 0, a huge context hung making prompts, and
        ``max_running=0`` burned 20,000 steps to report a liveness failure. (The pool,
        tier and worker counts are checked against the layout by the simulator.)"""
        for name, (low, high) in _COUNTS.items():
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(name, f"{name}={value!r} must be an int in {low}..{high}")
        for name in _RATES:
            value = getattr(self, name)
            if value is None and name in ("fail_rate", "delay_rate", "abort_rate",
                                          "reset_rate"):
                continue  # drawn per seed
            if type(value) not in (int, float) or not (
                    math.isfinite(value) and 0 <= value <= 1):
                raise ConfigError(name, f"{name}={value!r} must be a share in 0..1")
        if self.preempt_rate >= 1:
            raise ConfigError("preempt_rate", "preempt_rate=1 preempts a request every "
                              "step, so no run settles; use a share below 1")
        for name in _FLAGS:
            if type(getattr(self, name)) is not bool:
                raise ConfigError(name, f"{name}={getattr(self, name)!r} must be True or "
                                  "False")
        if self.policy is not None and self.policy not in ("lru", "arc"):
            raise ConfigError("policy", f"policy={self.policy!r}: use 'lru', 'arc' or None "
                              "(drawn per seed)")
        if self.lockstep and self.hostile:
            raise ConfigError("hostile", "lockstep=True with hostile=True: the bad twins "
                              "would reach the reference model, which is not built to "
                              "bounce them; run each on its own, as kvcore check's "
                              "refinement and bad-calls stages do")
        if self.lockstep and self.policy == "arc":
            raise ConfigError("policy", "lockstep=True needs policy='lru' (or None): the "
                              "reference tier is LRU")
        if self.stream_fault_rate and not self.simulate_stream:
            raise ConfigError("stream_fault_rate", "the stand-in stream fails copies only "
                              "when it runs them: set simulate_stream=True too")

    def drawn(self) -> SimOptions:
        """A copy with every unset rate drawn from the seed (printed first by the CLI)."""
        rng = random.Random(f"options:{self.seed}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        defaults = {"fail_rate": rng.choice([0.0, 0.02, 0.1]),
                    "delay_rate": rng.choice([0.0, 0.2, 0.5]),
                    "abort_rate": rng.choice([0.0, 0.02]),
                    "reset_rate": rng.choice([0.0, 0.0, 0.01]),
                    "num_workers": rng.choice([1, 2, 4]),
                    "policy": rng.choice(["lru", "arc"])}
        if self.lockstep:
            defaults["policy"] = "lru"  # the reference tier is LRU
        for name, value in defaults.items():
            if values[name] is None:
                values[name] = value
        return SimOptions(**values)


def speculative_off(config: OffloadConfig) -> OffloadConfig | None:
    """``config`` as an engine serving the same model without its EAGLE/MTP drafter has it:
    the draft groups dropped; None where that leaves the layout unchanged or empty.

    The draft group's extra chunk keeps the hit at least one of its chunks below a
    prompt's end, which shadows the N - 1 limit and the window rules near the end: with
    the drafter on, a mistake there changes nothing; with it off, it changes the hit.
    """
    kept = tuple(g for g in config.groups if not g.is_draft)
    if not config.speculative or not kept or len(kept) == len(config.groups):
        return None
    return replace(config, groups=kept, speculative=False, draft_kv_elsewhere=False)


@dataclass
class PromptSource:
    """Prompts with shared prefixes: a few system prompts, then per-request text."""

    rng: random.Random
    context_tokens: int
    shared_prefix_rate: float
    aligned_rate: float = 0.0
    align: int = 1
    systems: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for _ in range(3):
            n = max(1, int(self.context_tokens * self.rng.uniform(0.3, 0.8)))
            self.systems.append(self.tokens(n))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 50_000) for _ in range(n)]

    def prompt(self) -> list[int]:
        total = max(2, int(self.context_tokens * self.rng.uniform(0.7, 1.0)))
        if self.rng.random() < self.shared_prefix_rate:
            system = self.rng.choice(self.systems)[:total]
            out = system + self.tokens(total - len(system) + self.rng.randrange(1, 32))
        else:
            out = self.tokens(total)
        return self.aligned(out)

    def aligned(self, prompt: list[int]) -> list[int]:
        """``prompt``, or (at ``aligned_rate``) its longest prefix of whole ``align``-token
        chunks (padded up to one chunk), or that and one token: a follow-up cut so ends
        inside the earlier request's tokens, all of them in the tier. Drawn only when the
        rate is set, so runs without aligned prompts keep their seeds."""
        if self.aligned_rate and self.rng.random() < self.aligned_rate:
            # Every other one a token longer: its last boundary is the N - 1 limit itself.
            keep = max(self.align, len(prompt) // self.align * self.align) \
                + self.rng.randrange(2)
            return (prompt + self.tokens(keep - len(prompt)))[:keep]
        return prompt
