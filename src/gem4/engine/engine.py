"""The engine: requests in, streams of events out.

Thread model (what runs where):

- **Caller threads** (a CLI, HTTP handlers, tests) call `submit`, `generate` and `abort`. `submit`
  tokenizes and validates the request in the caller's thread (errors are raised there, at once),
  then hands a `Sequence` to the engine through an inbox and returns a `Stream`: a per-request
  queue of `GenerationEvent`s that the caller reads at its own pace. `abort` only records the
  request id. Both take one short lock and never touch the model.
- **The engine thread** is the only thread that touches the model, the KV caches, the sampler
  generators, the scheduler and the sequences. It is started by `submit` when there is work and
  exits when there is none left, so at most one exists at a time and an idle engine holds no
  thread. Each iteration: take the inbox and the abort requests (under the lock), then one step
  outside it: `schedule` (policy, no tensors) -> `runner.run` (tensors) -> `postprocess` (stop
  logic, text) -> put each request's events on its queue.
- **Several choices** (`submit(..., n=3)`, OpenAI's `n`): one request, one stream; its events carry the
  choice's `index` and the stream ends after every choice's final event. The prompt is prefilled once
  and the choices fork off it (scheduler.py says how), sharing its KV blocks until they write. Seeds:
  choice i samples with `seed + i` (vLLM's rule), so the choices differ from each other, the whole
  response is reproducible, and choice i's tokens are exactly those of the same request with n=1 and
  seed `seed + i` (unseeded choices draw from torch's global generator). n is at most max_num_seqs
  (all choices of a request run at once).
- **Cancellation** is a flag checked between steps: an aborted request gets its final "abort" event
  before the next step starts, so it stops within one step of `abort()` returning. A consumer that
  closes or drops the iterator `generate()` returned before the end aborts its request the same way.
  `shutdown()` aborts every request, refuses new ones and joins the engine thread (a CLI interrupted by
  Ctrl-C, a server stopped by SIGTERM: the process must not exit while the thread is inside a compiled op).

Errors:
- **Bad requests** are refused by `submit`, in the caller's thread, before the engine sees them:
  `SamplingParams` checks every parameter's type and range when it is built, `submit` checks what
  depends on the model (top_k and token ids against the vocabulary, lengths against the context).
  Parameter errors are `InvalidParameter` (a ValueError whose `param` names the field: the server
  answers 400 with that `param`); the others are plain ValueErrors.
- **A failure while serving** ends only the requests it concerns (runner.py says how each part of a
  step is isolated): their streams raise `EngineError` with the cause chained, the error is logged once
  on the "gem4.engine" logger (request id and step; never the prompt or the tokens), and the other
  requests of the step continue as if it had not happened. Non-finite logits are such a failure
  (`NonFiniteLogits`): the request ends at that step and no token is drawn from them; so is a constrained
  request's grammar failing (`gem4.structured.MatcherError`: it does not compile, it reaches a parser limit,
  it allows no token; engine/grammar.py). This is the
  engine's error finish; vLLM calls it finish_reason "error" (FinishReason.ERROR), which its OpenAI
  server turns into a 500 or a streamed error object, exactly what our server does with `EngineError`,
  so "error" never appears as a finish_reason on the wire. The unit of failure is the request: when one
  choice fails the request's other choices end with it (one response, one error).
- Only a failure outside any one request (the scheduler itself) ends every request in flight; the
  engine thread then exits and the next `submit` starts a fresh one.
"""
from __future__ import annotations

import logging
import queue
from collections import Counter
import threading
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gem4.engine.runner import Failed, ModelRunner, NonFiniteLogits
from gem4.engine.scheduler import Batch, Scheduler
from gem4.engine.sequence import ABORT, MediaInput, RequestStats, Sequence, Status, next_request_id
from gem4.engine.mtp import DRAFT_SLACK, MtpDrafter
from gem4.engine.pool import kv_pool_size
from gem4.engine.speculative import SpeculativeConfig
from gem4.kv_cache import BLOCK_SIZE, BlockManager, KVPool, kv_cache_dtype as stored_kv_dtype
from gem4.sampling import SEED_MAX, InvalidParameter, SamplingParams
from gem4.structured import GrammarStats, grammar_vocab
from gem4.weights.assistant import load_assistant

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gem4.engine")
VOCAB_AFTER_S = 1.0      # an idle engine starts building its grammar vocabulary this long after construction


class EngineError(RuntimeError):
    """The engine failed while serving this request (the cause is chained)."""


class EngineClosed(RuntimeError):
    """`submit` after `shutdown`."""


@dataclass(frozen=True)
class GenerationEvent:
    """One step of one request. The last event of a stream has `finish_reason` set and `stats`."""

    request_id: str
    token_id: int | None            # the token sampled this step; None on an abort event
    text: str                       # new text that is now certain (may be '')
    finish_reason: str | None       # None while running; then "stop" | "length" | "abort"
    stop_reason: int | str | None   # the end token id or stop string that ended the request
    prompt_tokens: int
    completion_tokens: int          # tokens generated so far, this one included
    logprob: float | None = None                          # when params.logprobs
    top_logprobs: list[tuple[int, float]] | None = None   # when params.top_logprobs > 0
    stats: RequestStats | None = None                     # on the last event only
    index: int = 0                                        # the choice (0..n-1) this event belongs to
    cached_tokens: int = 0                                # prompt tokens found in the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ERROR = object()   # queue marker: the engine failed; the exception follows


class Stream:
    """The events of one request, in order (with n choices: interleaved, each with its `index`);
    iteration ends after the final event of every choice."""

    def __init__(self, engine: "Engine", request_id: str, prompt_ids: list[int], n: int = 1):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.n = n
        self._engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._open = n                      # choices without their final event yet
        self.finished = False

    def get(self, timeout: float | None = None) -> GenerationEvent:
        """The next event (blocks; raises queue.Empty after `timeout` seconds)."""
        item = self._queue.get(timeout=timeout)
        if item is _ERROR:
            self.finished = True
            cause = self._queue.get()
            raise EngineError(f"{self.request_id}: generation failed: {cause}") from cause
        if item.finished:
            self._open -= 1
            self.finished = self._open == 0
        return item

    def __iter__(self) -> Iterator[GenerationEvent]:
        while not self.finished:
            yield self.get()

    def abort(self) -> None:
        self._engine.abort(self.request_id)

    def _put(self, item) -> None:
        self._queue.put(item)


class Generation:
    """What `Engine.generate` returns: an iterator over one request's events that aborts the request
    when it is closed, used as a context manager, or dropped before the final event."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.request_id = stream.request_id

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenerationEvent:
        if self.stream.finished:
            raise StopIteration
        return self.stream.get()

    def close(self) -> None:
        if not self.stream.finished:
            self.stream.abort()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _build_vocab_if_idle(lock: threading.Lock, busy: threading.Event, vocab) -> None:
    """The grammar vocabulary timer's work (Engine._schedule_vocab): start the build unless the engine has
    run or shut down since the timer was set."""
    with lock:
        if not busy.is_set():
            vocab.start()


class Engine:
    """Generation over one model: continuous batching of chunked prefills and decodes over one KV pool,
    sampling, stop logic, streaming.

    model: a `gem4.load(...)` Model. tokenizer: a `gem4.Tokenizer`, needed for text prompts, text
    deltas and stop strings (without it prompts are token ids and events carry ids only).
    prefill_chunk: most tokens of one sequence per step (also the slack of each sliding-layer ring).
    max_model_len: cap on prompt + generated tokens (default and upper bound: the model's
    max_position_embeddings).
    end_token_ids: the ids that end generation (unless params.ignore_eos); default: the tokenizer's
    end-of-generation ids (`tokenizer.special.end_of_generation`), none without one.
    max_num_seqs: requests running at once, decoded together (1 = strictly one after the other).
    max_num_batched_tokens: tokens per step, all sequences together (default max(prefill_chunk,
    max_num_seqs)).
    kv_cache_bytes: the KV pool's size (`kv_pool_size` says what it holds); default: room for
    max_num_seqs sequences of max_model_len, capped at half the memory available, and never less than
    one sequence of max_model_len.
    enable_prefix_caching: reuse the K/V of the longest cached prefix of each prompt -- of finished,
    aborted and running requests alike -- computing only the rest (kv_cache/blocks.py says how it stays
    exact on sliding layers). On by default, as in vLLM; the pool then keeps twice the sliding-window
    blocks (engine/pool.py's SLIDING_CACHE_FACTOR).
    block_size: positions per KV block (vLLM's --block-size): the unit of paging, sharing and eviction.
    kv_cache_dtype: what the KV pool stores (vLLM's --kv-cache-dtype): "auto" (the model's dtype: bf16 in the
    fast mode, float32 in the reference mode), "bfloat16", "int8" (a float32 scale per position and KV head) or
    "fp8_e4m3" -- the 8-bit forms hold twice the tokens in the same bytes, at a measured drift
    (docs/fast-mode.md); a torch dtype is taken as well. `kv_pool_size` counts the stored bytes, scales included.
    speculative_config: vLLM's speculative config (`speculative.SpeculativeConfig`: a dict or JSON string,
    e.g. {"method": "ngram", "num_speculative_tokens": 4} or {"method": "mtp", "model": ASSISTANT, ...}):
    each decode step of a request carries up to K drafts -- prompt lookup's, or the Gemma 4 assistant's
    (engine/mtp.py, loaded with gem4.load_assistant and checked against this model) -- verified in the same
    forward by exact rejection sampling (speculative.verify), so a request's tokens are the ones plain
    decoding gives (greedy: the same tokens; seeded: the same draws).
    structured: accept constrained requests (`SamplingParams.structured`, docs/structured.md). With a
    tokenizer and end ids, the grammar vocabulary (`gem4.structured.GrammarVocab`, 1-3.5 s for a full
    Gemma 4 vocabulary, most of it in llguidance holding the GIL) is built in a background thread that
    starts while the engine is idle -- VOCAB_AFTER_S after construction, or after the engine last ran out of
    work -- so it delays no unconstrained request; a constrained request starts it at once if it has not
    started, and waits for it. False: no vocabulary, constrained requests are refused at `submit`.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        prefill_chunk: int = 256,
        max_model_len: int | None = None,
        end_token_ids: Seq[int] | None = None,
        max_num_seqs: int = 1,
        max_num_batched_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        block_size: int = BLOCK_SIZE,
        kv_cache_dtype: str | torch.dtype = "auto",
        speculative_config=None,
        structured: bool = True,
    ):
        context = model.config.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= context:
            raise ValueError(f"max_model_len must be in [1, {context}] (the model's context length), "
                             f"got {max_model_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len or context
        if end_token_ids is None:
            end_token_ids = tokenizer.special.end_of_generation if tokenizer is not None else ()
        self.end_token_ids = frozenset(int(i) for i in end_token_ids)
        self.prefill_chunk = prefill_chunk
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.speculative_config = None if speculative_config is None else SpeculativeConfig.parse(speculative_config)
        mtp = self.speculative_config is not None and self.speculative_config.method == "mtp"
        assistant = load_assistant(self.speculative_config.model, target=model) if mtp else None
        slack = DRAFT_SLACK if mtp else 0                # the assistant reads two sliding positions more
        self.kv_cache_dtype = stored_kv_dtype(kv_cache_dtype, model.dtype)
        self.pool_size = kv_pool_size(model.config, self.kv_cache_dtype, max_chunk=prefill_chunk,
                                      num_seqs=max_num_seqs, max_model_len=self.max_model_len, budget=kv_cache_bytes,
                                      prefix_caching=enable_prefix_caching, block_size=block_size,
                                      window_slack=slack)
        pool = KVPool(model.config, num_blocks=self.pool_size.num_blocks,
                      num_sliding_blocks=self.pool_size.num_sliding_blocks, dtype=self.kv_cache_dtype,
                      device=model.device, block_size=block_size)
        blocks = BlockManager(pool.num_blocks, pool.block_size, pool.num_sliding_blocks, pool.window + slack,
                              caching=enable_prefix_caching)
        drafter, k = None, 0
        if self.speculative_config is not None:
            k = self.speculative_config.num_speculative_tokens
            drafter = MtpDrafter(assistant, model, pool, blocks, k) if mtp else self.speculative_config.ngram()
        self._scheduler = Scheduler(blocks, prefill_chunk, max_num_seqs, max_num_batched_tokens,
                                    num_speculative_tokens=k)
        self.grammar_stats = GrammarStats()             # compile and mask times, structured requests by kind
        self.grammar_vocab = grammar_vocab(tokenizer, self.vocab_size, self.end_token_ids, start=False) \
            if structured and tokenizer is not None and self.end_token_ids else None
        self._runner = ModelRunner(model, pool, blocks, drafter, self.grammar_vocab, self.grammar_stats)
        # shared with caller threads, guarded by _lock
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[tuple[str, int | None]] = set()   # (request id, choice index or None: all)
        self._streams: dict[str, Stream] = {}
        self._open: dict[str, int] = {}                 # request id -> choices not finished yet
        self._thread: threading.Thread | None = None
        self._closed = False                            # shutdown() was called: submit refuses
        self._busy: threading.Event | None = None       # set when the engine stops being idle (see _schedule_vocab)
        self.steps = 0                                  # engine steps run (forward passes)
        self.spec_drafts = 0                            # verification steps with drafts
        self.spec_draft_tokens = 0                      # drafts checked
        self.spec_accepted_tokens = 0                   # drafts accepted
        self.spec_accepted_per_position: Counter[int] = Counter()   # draft position (0-based) -> accepted
        self.batch_sizes: Counter[int] = Counter()      # steps by the number of sequences they ran
        self.step_tokens: Counter[int] = Counter()      # steps by the number of tokens they ran
        self._schedule_vocab()

    # ---- caller threads ----

    def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, n: int = 1, detokenize: bool = True,
               media: Seq[MediaInput] = ()) -> Stream:
        """Queue a request for `n` choices (see the module docstring); returns its event stream. Raises
        ValueError for a request that cannot run (`InvalidParameter` for a sampling parameter or n).
        detokenize=False: the events carry token ids only (text ''), for a caller that reads the ids itself
        (the server's chat output parser); stop strings need the text, so they are refused then.
        media: the prompt's images and audio clips (engine/media.py `media_prompt` builds both), their soft
        tokens at the positions of their placeholders."""
        if not detokenize and params is not None and params.stop:
            raise ValueError("stop strings need the text: submit with detokenize=True")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        self._check_media(prompt_ids, media)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        self._check_params(params)
        self._check_n(n, params)
        request_id = request_id if request_id is not None else next_request_id()
        now = time.perf_counter()
        seqs = [Sequence(request_id, prompt_ids, params if params.seed is None or i == 0
                         else replace(params, seed=params.seed + i),             # choice i: seed + i
                         max_tokens=max_tokens, end_ids=self.end_token_ids, arrival_time=now, index=i,
                         detokenizer=self.tokenizer.detokenizer(skip_special=True)
                         if self.tokenizer is not None and detokenize else None, media=media)
                for i in range(n)]
        seq = seqs[0]
        seq.forks = seqs[1:]
        stream = Stream(self, request_id, prompt_ids, n)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._open[request_id] = n
            if params.structured is not None:
                self.grammar_stats.requests[params.structured.kind] += 1
                self.grammar_vocab.start()                # needed now (a thread start: returns at once)
            self._inbox.append(seq)
            if self._thread is None:
                if self._busy is not None:
                    self._busy.set()
                self._thread = threading.Thread(target=self._loop, name="gem4-engine", daemon=True)
                self._thread.start()
        return stream

    def shutdown(self, timeout: float | None = None) -> bool:
        """Abort every request in flight (each stream gets its final "abort" event, as with `abort`), refuse
        new ones, and wait up to `timeout` seconds (None: no limit) for the engine thread to end: within one
        step. True when no engine thread is left. Call it before the process exits while requests may run:
        a daemon thread still inside a compiled op when the interpreter finalizes aborts the process (a grammar
        vocabulary build in progress is waited for too, up to `timeout`)."""
        with self._lock:
            self._closed = True
            if self._busy is not None:
                self._busy.set()
            self._aborts.update((request_id, None) for request_id in self._streams)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if self.grammar_vocab is not None:            # a vocabulary build in progress: let it leave llguidance
            self.grammar_vocab.join(timeout)
        return thread is None or (thread is not threading.current_thread() and not thread.is_alive())

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, n: int = 1, media: Seq[MediaInput] = ()) -> Generation:
        """Submit now (errors raise here) and return an iterator over the events; closing or dropping
        it before the final event aborts the request."""
        return Generation(self.submit(prompt, params, request_id=request_id, n=n, media=media))

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Ask the engine to stop a request -- or, with `index`, only that choice of it (the others go on;
        the server ends a choice early at a stop string) -- which then ends with an "abort" event within one
        step. A choice that still waits to be forked off its parent's prompt is dropped with its abort event
        the same way; choice 0 of a request whose other choices have not been forked yet is stopped only
        with them (its prompt is theirs). Returns False if the request is not in flight (unknown or already
        finished)."""
        with self._lock:
            if request_id not in self._streams:
                return False
            self._aborts.add((request_id, index))
            return True

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (their KV freed for older ones; recomputed later)."""
        return self._scheduler.num_preemptions

    @property
    def prefix_caching(self) -> bool:
        """Whether the prefix cache is on (the block manager's)."""
        return self._scheduler.blocks.caching

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """(queries, hits): prompt tokens looked up in the prefix cache so far, and those found."""
        return self._scheduler.prefix_queries, self._scheduler.prefix_hits

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's full-attention blocks in use."""
        return self._scheduler.blocks.usage

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting): sequences in the running batch, and those queued behind them (the
        scheduler's waiting queue, preempted ones included, and the inbox). Any thread; for metrics."""
        with self._lock:                                  # the inbox's hand-over to the scheduler is atomic
            return len(self._scheduler.running), len(self._scheduler.waiting) + len(self._inbox)

    def _schedule_vocab(self) -> None:
        """Start the grammar vocabulary's build VOCAB_AFTER_S from now if the engine has stayed idle until then
        (construction, and each time the engine runs out of work, until it has started): its GIL hold then
        delays no request, and a process that ends at once (`gem4 run`) never starts it.

        The timer holds the lock, the vocabulary and an Event set when the engine stops being idle, never the
        engine: a timer thread holding it would, once it ended after the engine was dropped, drop the last
        reference and free the model's tensors in that daemon thread, which aborts the process ("terminate
        called without an active exception") when it happens while the interpreter finalizes."""
        if self.grammar_vocab is not None and not self.grammar_vocab.started:
            self._busy = threading.Event()
            timer = threading.Timer(VOCAB_AFTER_S, _build_vocab_if_idle, (self._lock, self._busy, self.grammar_vocab))
            timer.daemon = True
            timer.start()

    def idle(self) -> bool:
        with self._lock:
            return self._thread is None

    # ---- validation (caller thread) ----

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (Engine(model, tokenizer)); or pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_media(self, ids: list[int], media: Seq[MediaInput]) -> None:
        """Every media item on its own placeholders, in order, inside the prompt; a tower for its kind; a
        bidirectional one no longer than a prefill chunk (it is computed in one); no stray placeholder."""
        placeholder = {}                                    # kind -> its placeholder id, for the model's towers
        vision, audio = getattr(self.model, "vision", None), getattr(self.model, "audio", None)
        if vision is not None:
            placeholder["image"] = vision.config.image_token_id
            if vision.config.video_token_id is not None:
                placeholder["video"] = vision.config.video_token_id
        if audio is not None:
            placeholder["audio"] = audio.config.audio_token_id
        end = 0
        for m in media:
            if m.kind not in placeholder:
                raise ValueError(f"this model has no tower for media of kind {m.kind!r}")
            if not (end <= m.start and m.num_tokens >= 1 and m.end <= len(ids)):
                raise ValueError(f"a media item at positions [{m.start}, {m.end}) overlaps another or lies "
                                 f"outside the {len(ids)}-token prompt")
            if any(t != placeholder[m.kind] for t in ids[m.start:m.end]):
                raise ValueError(f"the prompt's tokens at [{m.start}, {m.end}) are not the {m.kind}'s placeholders")
            if m.bidirectional and m.num_tokens > self._scheduler.max_chunk:
                raise ValueError(f"an {m.kind} of {m.num_tokens} tokens is longer than the prefill chunk "
                                 f"({self._scheduler.max_chunk}), which must hold it whole")
            end = m.end
        for kind, token_id in placeholder.items():
            if ids.count(token_id) != sum(m.num_tokens for m in media if m.kind == kind):
                raise ValueError(f"the prompt has {kind} placeholders without an {kind}")

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the parts that depend on this engine's model."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (Engine(model, tokenizer))")
        if params.top_k > self.vocab_size:
            raise InvalidParameter("top_k", f"must be at most the vocabulary size {self.vocab_size} "
                                            f"(0 or -1 = off), got {params.top_k}")
        if params.structured is not None and self.grammar_vocab is None:
            raise InvalidParameter("structured", "constrained decoding needs an engine with a tokenizer and "
                                                 "end-of-generation ids, built with structured=True")
        budget = params.thought_budget
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                          ("thought_budget", [] if budget is None else [budget.open_id, budget.close_id])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter(name, f"token ids must be < the vocabulary size {self.vocab_size}, got {bad}")

    def _check_n(self, n: int, params: SamplingParams) -> None:
        """n choices must run at once (one ring slot each), and seed + n - 1 must still be a seed."""
        max_n = self._scheduler.max_num_seqs
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
            raise InvalidParameter("n", f"must be an integer in [1, {max_n}] (max_num_seqs: the choices run at "
                                        f"once), got {n!r}")
        if params.seed is not None and params.seed + n - 1 > SEED_MAX:
            raise InvalidParameter("seed", f"choice i samples with seed + i, so seed + n - 1 must be at most "
                                           f"2^64 - 1 (got seed {params.seed} with n={n})")

    def _max_tokens(self, n_prompt: int, params: SamplingParams) -> int:
        room = self.max_model_len - n_prompt
        if room < 1:
            raise ValueError(f"the prompt has {n_prompt} tokens; the context length is {self.max_model_len}, "
                             f"which leaves no room to generate")
        if params.max_tokens is None:
            return room                                  # generate until the context is full
        if params.max_tokens > room:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{n_prompt + params.max_tokens} exceeds the context length {self.max_model_len}")
        return params.max_tokens

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            with self._lock:
                for seq in self._inbox:
                    self._scheduler.add(seq)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, set()
                if not aborts and not self._scheduler.has_work():
                    self._thread = None
                    self._schedule_vocab()
                    return
            for request_id, index in aborts:
                self._abort(request_id, index)
            try:
                self._step()
            except BaseException as e:   # noqa: BLE001 - handed to every consumer, then the thread ends
                log.error("engine step %d failed outside any one request; ending every request in flight",
                          self.steps, exc_info=e)
                self._fail(e)
                return

    def _step(self) -> None:
        batch = self._scheduler.schedule()
        if not batch.chunks:
            return
        now = time.perf_counter()
        for chunk in batch.chunks:
            if chunk.seq.scheduled_time is None:
                chunk.seq.scheduled_time = now
        samples = self._runner.run(batch)
        step = self.steps
        self.steps += 1
        self.batch_sizes[len(batch.chunks)] += 1
        self.step_tokens[batch.num_tokens] += 1
        for chunk, sample in zip(batch.chunks, samples, strict=True):
            if chunk.seq.is_finished:                     # another choice of its request failed this step
                continue
            if isinstance(sample, Failed):
                self._fail_one(chunk.seq, sample.error, step)
                continue
            try:                                          # one request's text and stop logic at a time
                outputs = self._scheduler.postprocess(Batch((chunk,)), [None if sample is None else sample.token_ids],
                                                      time.perf_counter())
            except Exception as e:                        # noqa: BLE001 - this request's failure only
                self._fail_one(chunk.seq, e, step)
                continue
            if sample is not None and sample.drafts:
                self._count_drafts(chunk.seq, sample)
            before = len(chunk.seq.output_ids) - len(outputs)
            for k, (seq, out) in enumerate(outputs):     # one event per token, accepted drafts included
                finished = out.finish_reason is not None
                self._publish(seq, GenerationEvent(
                    request_id=seq.request_id, token_id=out.token_id, text=out.text,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    prompt_tokens=seq.num_prompt_tokens, completion_tokens=before + k + 1,
                    logprob=None if sample.logprobs is None else sample.logprobs[k],
                    top_logprobs=None if sample.top_logprobs is None else sample.top_logprobs[k],
                    stats=seq.stats() if finished else None, index=seq.index,
                    cached_tokens=seq.num_cached_tokens or 0,
                ), finished)

    def _count_drafts(self, seq: Sequence, sample) -> None:
        """Speculation counters (vLLM's spec_decode_* metrics): a verification step, its drafts, and how
        many were accepted, by draft position; the request's own in its stats."""
        accepted = len(sample.token_ids) - 1
        seq.record_drafts(sample.drafts, accepted)
        self.spec_drafts += 1
        self.spec_draft_tokens += sample.drafts
        self.spec_accepted_tokens += accepted
        for position in range(accepted):
            self.spec_accepted_per_position[position] += 1

    def _fail_one(self, seq: Sequence, error: BaseException, step: int) -> None:
        """End one request with `error` (its stream raises EngineError), every choice of it; log it once."""
        if isinstance(error, NonFiniteLogits):            # a model fault, not a bug: no traceback
            log.error("request %s failed at engine step %d: %s", seq.request_id, step, error)
        else:
            log.error("request %s failed at engine step %d: %s: %s", seq.request_id, step,
                      type(error).__name__, error, exc_info=error)
        for s in {seq, *self._scheduler.remove(seq.request_id, failed=True)}:
            s.status = Status.FINISHED                    # its other chunks of this step are skipped
            self._runner.release(s.seq_id)
        with self._lock:
            stream = self._streams.pop(seq.request_id, None)
            self._open.pop(seq.request_id, None)
        if stream is not None:
            stream._put(_ERROR)
            stream._put(error)

    def _abort(self, request_id: str, index: int | None = None) -> None:
        now = time.perf_counter()
        for seq in self._scheduler.remove(request_id, index=index):    # [] if it finished meanwhile
            text = seq.abort(now)
            self._publish(seq, GenerationEvent(
                request_id=request_id, token_id=None, text=text, finish_reason=ABORT, stop_reason=None,
                prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(seq.output_ids), stats=seq.stats(),
                index=seq.index,
            ), True)

    def _publish(self, seq: Sequence, event: GenerationEvent, finished: bool) -> None:
        if finished:
            self._runner.release(seq.seq_id)
        with self._lock:
            stream = self._streams[seq.request_id]
            if finished:
                self._open[seq.request_id] -= 1
                if not self._open[seq.request_id]:
                    del self._streams[seq.request_id], self._open[seq.request_id]
        stream._put(event)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            seqs = list(self._scheduler.running) + list(self._scheduler.waiting) + self._inbox
            seqs += [c for s in seqs for c in s.forks]
            self._scheduler.running.clear()
            self._scheduler.waiting.clear()
            self._inbox.clear()
            self._aborts.clear()
            streams = [self._streams.pop(s.request_id) for s in seqs if s.request_id in self._streams]
            for s in seqs:
                self._open.pop(s.request_id, None)
            self._thread = None
        for seq in seqs:
            self._scheduler.blocks.free(seq.seq_id)
            self._runner.release(seq.seq_id)
        for stream in streams:
            stream._put(_ERROR)
            stream._put(error)
