"""Frozen configuration, one dataclass per component; CLI flags derive from these fields."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The built-in model served when none is named (radixlm.runtime.model.source resolves it).
DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("auto", "bfloat16", "float32", "float16")  # auto: radixlm.runtime.model.formats.choose_dtype


def default_cache_dir() -> Path:
    """$RADIXLM_CACHE, else ~/.cache/radixlm (read when a config is built, never at import)."""
    return Path(os.environ.get("RADIXLM_CACHE") or Path.home() / ".cache" / "radixlm")


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "cpu"
    # auto | none | a name in radixlm.runtime.model.quant_linear.QUANT_METHODS (weight-only, CPU only);
    # auto: the GGUF's 4-bit weights on a bf16 CPU, else none (radixlm.runtime.model.formats)
    quantization: str = "auto"
    # with quantized weights, steps of more rows than this multiply a dense copy kept next to
    # them (more memory, faster batches and prefill); None: 1 under auto, no copy under int8/q4
    quant_dense_above: int | None = None
    cache_dir: str = field(default_factory=lambda: str(default_cache_dir()))
    context_length: int | None = None  # default: the model's, capped at 8192
    seed: int = 0  # for dummy weights
    tokenizer_path: str | None = None  # a tokenizer folder to use instead of the model's own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quant_dense_above is not None and self.quant_dense_above < 0:
            raise ValueError(f"quant_dense_above must be >= 0, got {self.quant_dense_above}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")


@dataclass(frozen=True)
class CacheConfig:
    cache: str = "radix"  # a name in radixlm.runtime.radix_cache.CACHES
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    # KV pool share of free memory: of RAM on CPU; on CUDA, of the GPU memory left after the
    # weights and a reserve for activations and CUDA graphs. None: 0.15 on CPU, 0.85 on CUDA.
    mem_fraction: float | None = None
    # Sessions' KV stays locked between turns up to this many tokens (least recently used
    # sessions are unpinned past it); None: half the KV pool; 0 turns pinning off.
    max_pinned_tokens: int | None = None
    session_ttl: float = 600.0  # seconds an idle session stays open (open_session may set its own)

    def fraction_for(self, device_type: str) -> float:
        """mem_fraction, or the device's default."""
        if self.mem_fraction is not None:
            return self.mem_fraction
        return 0.85 if device_type == "cuda" else 0.15

    def __post_init__(self) -> None:
        if self.max_pinned_tokens is not None and self.max_pinned_tokens < 0:
            raise ValueError(f"max_pinned_tokens must be >= 0 (0 = no pinning), got {self.max_pinned_tokens}")
        if not self.session_ttl > 0:
            raise ValueError(f"session_ttl must be > 0 seconds, got {self.session_ttl}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "lpm"  # a name in radixlm.runtime.scheduler.POLICIES
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # prompt tokens a step while others decode or wait; 0 turns chunking off
    max_prefill_tokens: int = 4096  # prompt tokens a step without chunking, and for a prompt alone
    # A step's prompt tokens are cut further to what is expected to run in this many seconds (the
    # cost of a prompt token measured on recent steps), so a request arriving meanwhile waits about
    # this long at most for the step in flight; 0: the token limits alone. It binds where prompts
    # are slow (a CPU); smaller steps would cost long prompts more than they spare short requests
    # (docs/engine.md, "Scheduling"; docs/machines.md).
    prefill_step_seconds: float = 0.25
    # While requests decode, pieces of prompts that take several steps make those decodes at most
    # this many times slower on average (measured): after a step slowed by a piece, steps of the
    # decodes (and of prompts that fit one step) run alone until the slowdown is paid back. 0: no
    # limit. The default keeps a short request behind a long prompt within about 3x its time
    # alone where prompts are slow (docs/machines.md).
    decode_slowdown: float = 2.0
    lpm_max_queue: int = 128  # past this many waiting requests, lpm falls back to fcfs
    # Admission reserves ratio * (remaining max_new_tokens) for each running request. Most
    # requests stop early, so the ratio decays step by step towards its floor; a retraction
    # (decode ran out of slots) resets it to the initial value.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    # Greedy decode steps are queued one step ahead of the host's work on the last step's tokens
    # (detokenizing, stop checks), so the device never waits for it; None: on with CUDA only.
    overlap_schedule: bool | None = None
    # Program-aware admission (docs/programs.md): requests of programs already running go before
    # those that start new programs, fork siblings are admitted together and a fork's prefix stays
    # locked until its branches are admitted. Off by default: it measured no better than off
    # (docs/machines.md; docs/benchmarks.md, "Program-aware scheduling on vs off").
    program_scheduling: bool = False
    # A request that starts a new program (or has none) waits for at most this many admissions of
    # running programs' requests preferred over it; then it goes first. 2048: at 64 the bound
    # turned most waiting programs urgent within a few steps, so the admission order fell back to
    # arrival order; measured in a closed loop of 64 programs (docs/benchmarks.md).
    program_fairness: int = 2048
    # New programs start only while fewer than this many started programs are under way (run by
    # the server and not ended; or, a client's, with a request waiting or running or between two of
    # its requests for up to program_gap_steps steps: the next one may be on its way); 0: twice
    # max_running_requests. Without it each step a program spent between two requests let a new
    # program start, and a closed loop of 64 programs on 16 rows ran up to 41 started programs at
    # once, oldest first, so the younger ones waited hundreds of steps between their requests.
    # Twice the rows: at one program a row some rows stayed empty (the programs under way had
    # nothing to run). 8 steps: on the GPU a program's next request came too late for 2, and a
    # /run_program program's round trip took several steps, at times more than 8, hence no gap for
    # the programs the server runs (docs/machines.md; docs/benchmarks.md).
    program_active_cap: int = 0
    program_gap_steps: int = 8

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_prefill_tokens", "lpm_max_queue", "program_fairness"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("program_active_cap", "program_gap_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0 (0 = off), got {self.chunked_prefill_size}")
        if not self.prefill_step_seconds >= 0:
            raise ValueError(f"prefill_step_seconds must be >= 0 (0 = no time limit), got {self.prefill_step_seconds}")
        if not (self.decode_slowdown == 0 or self.decode_slowdown > 1):
            raise ValueError(f"decode_slowdown must be > 1 (or 0 = no limit), got {self.decode_slowdown}")


JSON_WHITESPACE = ("compact", "spaced", "any")


@dataclass(frozen=True)
class ConstraintConfig:
    """Constrained decoding: which grammar engine, and how JSON output is laid out.

    ``compact`` JSON (``{"a":1,"b":2}``) makes the text the schema forces (``","b":``) as long
    as possible, so jump-forward skips the most; ``spaced`` uses ``", "`` / ``": "``; ``any``
    lets the model choose its whitespace (the grammar then forces little)."""

    grammar_backend: str = "llguidance"  # a name in radixlm.runtime.constrained.GRAMMAR_BACKENDS (docs/structured-output.md)
    # A json_schema llguidance refuses is compiled by xgrammar where it is installed (it enforces
    # exactly what it compiles, refusing what it would approximate); logged once per schema.
    grammar_fallback: bool = True
    jump_forward: bool = True  # requests may still turn it off with sampling_params.jump_forward
    # Jump forward only while at most this many requests run; above it the forced text is decoded
    # through the mask, one token a step. None: 1 on CUDA with the overlap schedule (planning jumps
    # costs a host-bound batch more than they spare), else no cap; below the cap a jump is taken when
    # it saves more than its extend step costs (JumpPolicy, measured at start-up on CUDA).
    jump_forward_max_running: int | None = None
    json_whitespace: str = "compact"
    # Greedy constrained rows skip the mask when the grammar allows the raw argmax (the same token;
    # masked and drawn again only when it does not). None: on the CPU, where a mask costs more than
    # the test; off on CUDA, where masks fill while the forward pass runs.
    mask_on_reject: bool | None = None
    # Threads of llguidance's pool that fills a step's masks together. One is the fastest for
    # rows of one grammar, which contend in its shared lexer (docs/machines.md;
    # docs/structured-output.md).
    grammar_fill_threads: int = 1
    grammar_compile_workers: int = 2
    grammar_cache_size: int = 1024
    # A compile past this many seconds fails its request (400); the spec is remembered as failed.
    grammar_compile_timeout: float = 30.0
    # Size limits checked before compiling (radixlm.runtime.constrained.limits.SpecLimits). A schema's
    # bytes are bounded loosely (real API schemas reach hundreds of KB): its compile is bounded by
    # the time limit above, the nesting limits and the grammar engine's own; a regex's, grammar's or
    # choices' cost grows faster than their bytes.
    grammar_max_bytes: int = 131_072
    grammar_max_schema_bytes: int = 1_048_576
    grammar_max_nesting: int = 128
    grammar_max_ref_nesting: int = 1024  # nesting with each $ref read as its target (llguidance recurses)
    grammar_max_enum: int = 4096
    grammar_max_repeat: int = 1_000_000

    def __post_init__(self) -> None:
        if self.json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {JSON_WHITESPACE}, got {self.json_whitespace!r}")
        for name in ("grammar_fill_threads", "grammar_compile_workers", "grammar_cache_size", "grammar_max_bytes",
                     "grammar_max_schema_bytes", "grammar_max_nesting", "grammar_max_ref_nesting", "grammar_max_enum",
                     "grammar_max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.jump_forward_max_running is not None and self.jump_forward_max_running < 0:
            raise ValueError(f"jump_forward_max_running must be >= 0, got {self.jump_forward_max_running}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}")


SPECULATIVE_ALGORITHMS = ("none", "ngram", "radix")
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/engine.md, "Speculative decoding"): a greedy request's next
    tokens are guessed from what the runtime holds and checked in one forward pass. ``ngram``:
    from the request's own prompt and output (prompt lookup); ``radix``: first from the radix
    cache (what follows the request's tokens in other requests, earlier turns, fork siblings),
    else as ``ngram``."""

    speculative_algorithm: str = "none"
    speculative_num_draft_tokens: int = 4  # the most draft tokens a step checks for a request

    def __post_init__(self) -> None:
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                             f"got {self.speculative_algorithm!r}")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {self.speculative_num_draft_tokens}")


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decode steps replayed as CUDA graphs (CUDA with the triton attention backend only)."""

    disable_cuda_graph: bool = False
    # the most rows (tokens) a captured step holds; None: max_running_requests + GRAPH_EXTEND_ROWS
    cuda_graph_max_bs: int | None = None

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one engine process per rank, over torch.distributed (docs/distributed.md)."""

    tp_size: int = 1  # ranks the model's heads, MLP and vocabulary are split over (SGLang's --tp-size)
    # A collective that waits this long for a rank fails the step and restarts the engine (never a hang).
    dist_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    constraint: ConstraintConfig = field(default_factory=ConstraintConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere

    @property
    def attention_backend_name(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.model.device.startswith("cuda") else "torch"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, each naming a field of one component."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _COMPONENTS}
        top: dict[str, Any] = {}
        owners = {f.name: part for part, typ in _COMPONENTS.items() for f in dataclasses.fields(typ)}
        for key, value in kwargs.items():
            if key in owners:
                parts[owners[key]][key] = value
            elif key == "attention_backend":
                top[key] = value
            else:
                valid = sorted([*owners, "attention_backend"])
                raise ValueError(f"unknown engine option {key!r}; valid options: {', '.join(valid)}")
        return cls(**{p: _COMPONENTS[p](**v) for p, v in parts.items()}, **top)

    def flat(self) -> dict[str, Any]:
        """The flat keyword arguments `from_kwargs` rebuilds this config from (JSON-safe)."""
        out: dict[str, Any] = {"attention_backend": self.attention_backend}
        for part in _COMPONENTS:
            out.update(dataclasses.asdict(getattr(self, part)))
        return out


_COMPONENTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
               "constraint": ConstraintConfig, "cuda_graph": CudaGraphConfig, "parallel": ParallelConfig,
               "speculative": SpeculativeConfig}
COMPONENT_TYPES = tuple(_COMPONENTS.values())
