"""Ollama: launch environment, the native NDJSON API, and what the server says about its KV cache.

Ollama is configured by environment variables, not flags: OLLAMA_KV_CACHE_TYPE (f16 | q8_0 | q4_0;
the quantised types take effect only with OLLAMA_FLASH_ATTENTION=1), OLLAMA_NUM_PARALLEL (sequences
run at once; requests beyond it queue in the server), OLLAMA_CONTEXT_LENGTH (per sequence: the runner
gets -c num_ctx x num_parallel) and OLLAMA_HOST. The model loads lazily on the first request, so
the KV lines of the server log exist only after `preload` (or a first request).

Streams are NDJSON: one JSON object per line; a token in `response` (/api/generate) or
`message.content` (/api/chat); a final object with done=true carrying done_reason and the server's
own counts and durations (nanoseconds). Go's omitempty drops zero-valued counts and durations from
that object. A missing prompt_eval_count or eval_count is recorded as None (unknown), not 0: servers
before mid-2024 (ollama/ollama#2068, #3427, fixed by #5371) dropped prompt_eval_count when the prompt
came from the prompt cache, and since then it is the whole prompt length, so a 0 never describes a
prompt kvexp sends. An error during a stream arrives as a line {"error": "..."} (HTTP status stays 200);
an error before the first line is an HTTP status with the same JSON body.

Models: a tag the user pulled (model.ollama), served from the user's own models folder; or a GGUF file
(model.gguf, the embedded models included), which kvexp imports into a launched server as
kvexp-<file stem> through the server's own API (POST /api/blobs/sha256:<digest>, then /api/create
with the file), in a models folder kvexp owns (OLLAMA_MODELS=<cache>/ollama/models): the blob is
stored once per machine and each job re-creates the tag in milliseconds.

There is no tokenizer endpoint (Ollama 0.24.0's routes: none; /api/embed counts by embedding). For a
GGUF kvexp imports, prompts are text of an exact length all the same: llama.cpp's tokenizer over the
same file finds text units of one token each before the first level (backends/gguf_tokenizer.py), and
two probes on the server measure what it adds (BOS, chat template). Ollama tokenizes the file's
vocabulary itself (llama.cpp's vocabulary code for most architectures, its own Go tokenizer for those
of its new engine), so the probes also check that it counts as llama.cpp does. For a pulled tag,
prompts are text of an estimated length (the realised length is the server's prompt_eval_count), no
ignore_eos (options.num_predict only caps the output), no KV usage
and no queue gauges. /api/ps states each loaded model's size and size_vram (`loaded_models`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import aiohttp

from kvexp.assets import embedded
from kvexp.assets.install import OLLAMA_VERSION, build_ollama, find_ollama
from kvexp.backends import gguf_tokenizer, openai
from kvexp.backends.base import (PORT, Adapter, BackendError, Capabilities, KVCacheInfo, Request, ServerSpec,
                                 StreamEvent, answer_json, reported_version)
from kvexp.backends.llamacpp import check_gguf_model
from kvexp.backends.ollamacache import (CPU_MEMORY, ENGINE_ARCHS, ENGINE_CACHE, RUNNER_CACHE, gguf_architecture,
                                       logged_buffers, parse_server_log)
from kvexp.capacity.cpumemory import CpuMemoryModel, ServerBuffers
from kvexp.core.config import BackendConfig, ConfigError, ExperimentConfig, server_slots
from kvexp.core.paths import cache_dir, sha256_of
from kvexp.workload import prompts, scenario

KV_TYPES = ("f16", "q8_0", "q4_0")  # what OLLAMA_KV_CACHE_TYPE accepts (Ollama's FAQ)
QUANTISED = ("q8_0", "q4_0")
# Environment variables the adapter sets itself; backend.env may not override them.
MANAGED_ENV = {
    "OLLAMA_HOST": "backend.host / backend.port",
    "OLLAMA_KV_CACHE_TYPE": "kv=",
    "OLLAMA_FLASH_ATTENTION": "backend.flash_attention",
    "OLLAMA_NUM_PARALLEL": "backend.parallel",
    "OLLAMA_CONTEXT_LENGTH": "backend.context",
}
# The serve process logs this once a model has loaded, after the runner's KV cache lines.
LOADED_LINE = "llama runner started in"
# The characters-per-token probe: at most this many characters of estimated text, from this seed.
PROBE_CHARS = 2000
PROBE_SEED = 7
UNLOAD_POLLS = 300  # x 0.1 s: how long a reset waits for the model to unload
TAG_PREFIX = "kvexp-"
# Prompts are text of an estimated token length and may tokenize longer than targeted: the context
# per sequence leaves room for PROMPT_SLACK x the target plus the output and a chat template. The
# requests send truncate=false, so a prompt that still does not fit fails loudly instead of being
# cut silently.
PROMPT_SLACK = 2.0
CONTEXT_PAD = 64
NS = 1e9
REPEAT_LIMIT = 30  # llm/server.go: a reply stops once tokenRepeat > 30


@dataclass
class OllamaConfig(BackendConfig):
    name: str = "ollama"
    binary: Optional[str] = None  # `ollama` on PATH by default
    flash_attention: bool = True
    # CPU threads of the runner (options.num_thread, sent with every request so the model never reloads);
    # None: all cores but one, as for llama-server, so that the load generator keeps a core
    threads: Optional[int] = None


# The scheduler's words when its runner dies (e.g. `kill -9`): it loads the model again for the next request
_RUNNER_GONE = re.compile(r'msg="(llama runner process no longer running)"[^\n]*?string="([^"]*)"')
_RUNNER_START = re.compile(r'msg="starting runner" cmd="[^"]*--model ')


def parse_ndjson_line(line: bytes) -> Optional[StreamEvent]:
    """One line of an /api/generate or /api/chat stream."""
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return StreamEvent(error=f"protocol: malformed JSON in stream: {line[:80]!r}")
    if not isinstance(data, dict):
        return StreamEvent(error="protocol: stream line is not a JSON object")
    if "error" in data:
        err = data["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        return StreamEvent(error=f"server: {msg}")
    done = data.get("done")
    if not isinstance(done, bool):
        return StreamEvent(error=f"protocol: stream object without a boolean 'done': {line[:80]!r}")
    message = data.get("message")
    if isinstance(message, dict):  # /api/chat
        text, thinking = message.get("content"), message.get("thinking")
    else:  # /api/generate
        text, thinking = data.get("response"), data.get("thinking")
    text = text if isinstance(text, str) else ""
    # A thinking model's reasoning tokens are output tokens too (they are in eval_count).
    content = bool(text) or bool(thinking)
    if not done:
        return StreamEvent(content=content, text=text)
    return StreamEvent(
        content=content, text=text, done=True,
        prompt_tokens=_count(data, "prompt_eval_count"), output_tokens=_count(data, "eval_count"),
        finish_reason=data.get("done_reason") or None, server_timings=_timings(data) or None,
    )


def _count(data: dict[str, Any], key: str) -> Optional[int]:
    v = data.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _timings(data: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, name in (("prompt_eval_duration", "prompt_eval_s"), ("eval_duration", "eval_s"),
                      ("total_duration", "total_s"), ("load_duration", "load_s")):
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = v / NS
    return out


class Ollama(Adapter):
    name = "ollama"
    display_name = "Ollama"
    chart_marker = "^"
    config_class = OllamaConfig
    model_field = "ollama"
    capabilities = Capabilities(forces_output_length=False,  # num_predict caps the output; it may stop earlier
                                exact_prompts=False,  # no tokenizer endpoint
                                offline_tokenizer=True,  # a GGUF kvexp imports (a pulled tag's spec says False)
                                exposes_kv_usage=False, exposes_preemptions=False, logprobs=False)
    cache_model = RUNNER_CACHE  # ENGINE_CACHE for a model Ollama runs on its own engine (ollamacache.py)
    health_path = "/api/version"
    b: OllamaConfig

    installable = True

    def __init__(self, cfg: ExperimentConfig, model: Optional[str], binary: Optional[str]):
        """model: a tag (model.ollama) or, without one, the GGUF file to import (model.gguf)."""
        tag = cfg.model.ollama
        if tag is not None and (not tag.strip() or tag.startswith("@")):
            raise ConfigError(f"model.ollama={tag!r} for model={cfg.model.name}: give an Ollama model tag "
                              "(e.g. model.ollama=qwen2.5:7b-instruct-q4_K_M), pulled beforehand, or unset it "
                              "and give model.gguf to import a GGUF file")
        if tag is None and cfg.backend.endpoint:
            raise ConfigError(f"model.ollama is not set for model={cfg.model.name}: an attached Ollama server "
                              "(backend.endpoint) serves a tag it has; kvexp imports a GGUF only into a server "
                              "it launches")
        if tag is None and not cfg.model.gguf:
            raise ConfigError(f"model={cfg.model.name} sets neither model.ollama (a tag) nor model.gguf (a GGUF "
                              "file kvexp imports)")
        gguf = model or cfg.model.gguf
        gguf = embedded.gguf_path(gguf) if embedded.is_embedded(gguf) else gguf
        if tag is None and gguf and gguf_architecture(Path(gguf).expanduser()) in ENGINE_ARCHS:
            self.cache_model = ENGINE_CACHE
        super().__init__(cfg, model, binary)
        self._digest: Optional[str] = None  # of the GGUF kvexp imports, once known
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"kv={cfg.kv.name}: per_backend.ollama={self.kv_type!r}; OLLAMA_KV_CACHE_TYPE "
                              f"accepts {', '.join(KV_TYPES)}")
        if self.kv_type in QUANTISED and not self.b.flash_attention:
            raise ConfigError(f"kv={cfg.kv.name} ({self.kv_type}) needs backend.flash_attention=true: Ollama "
                              "applies a quantised OLLAMA_KV_CACHE_TYPE only with OLLAMA_FLASH_ATTENTION=1")
        for key, knob in MANAGED_ENV.items():
            if key in self.b.env:
                raise ConfigError(f"backend.env.{key}: kvexp sets it from {knob}; set that instead")

    @classmethod
    def locate_program(cls, cfg: ExperimentConfig) -> Optional[str]:
        program = find_ollama(cfg.backend.binary)
        if program is None:
            b = cfg.backend.binary
            where = f"backend.binary={b}: no such program" if b else "ollama not found"
            raise ConfigError(f"{where}: run `python -m kvexp install ollama` (builds Ollama {OLLAMA_VERSION} from "
                              "its Go module once) or set backend.binary=/path/to/ollama")
        return str(program)

    @classmethod
    def served_field(cls, model: Any) -> str:
        return "gguf" if model.ollama is None and model.gguf else "ollama"

    @classmethod
    def check_model(cls, cfg: ExperimentConfig) -> None:
        if not cfg.model.ollama:
            check_gguf_model(cfg)

    @classmethod
    def locate_model(cls, cfg: ExperimentConfig, program: Optional[str]) -> Optional[str]:
        if cfg.model.ollama:
            return cfg.model.ollama
        cls.check_model(cfg)
        gguf = cfg.model.gguf
        return str(embedded.gguf_file(gguf)) if embedded.is_embedded(gguf) else str(Path(str(gguf)).expanduser())

    @classmethod
    def install(cls, force: bool = False, build: str = "cpu") -> None:
        build_ollama(force=force)
        embedded.install_wheel_model()

    @property
    def imports(self) -> Optional[Path]:
        """The GGUF kvexp imports into the server (None: the server serves a tag it has)."""
        if self.cfg.model.ollama or self.model_path is None:
            return None
        return Path(self.model_path)

    @property
    def model_tag(self) -> str:
        gguf = self.imports
        if gguf is None:
            return str(self.cfg.model.ollama or self.model_path)
        name = re.sub(r"[^a-z0-9_.-]+", "-", gguf.stem.lower()).strip("-.") or "model"
        return TAG_PREFIX + name

    @property
    def threads(self) -> int:
        return self.b.threads or self.placement.server_threads

    def cpu_memory(self) -> Optional[CpuMemoryModel]:
        return CPU_MEMORY  # used where no GPU is known (kvexp/planning/prediction.py)

    @classmethod
    def logged_buffers(cls, log_text: str) -> Optional[ServerBuffers]:
        return logged_buffers(log_text)

    def numerics(self, kv_type: Optional[str] = None) -> dict[str, Any]:
        return {"flash_attention": str(self.b.flash_attention), "threads": self.threads}

    @property
    def parallel(self) -> int:
        return self.spec.slots or 1

    @property
    def context(self) -> int:
        """Context per sequence (Ollama multiplies it by OLLAMA_NUM_PARALLEL for the runner)."""
        return self.spec.context_tokens or 0

    def _spec(self) -> ServerSpec:
        """The server's whole configuration is its environment: Ollama takes its port from OLLAMA_HOST
        (port 0: the configured backend.port, else none and the server's default 11434)."""
        s, b = self.cfg.scenario, self.b
        slots, slots_source = server_slots(s, b.parallel)
        prompt, output = scenario.longest_request(s)
        context = b.context or int(prompt * PROMPT_SLACK) + output + CONTEXT_PAD
        sources = {"parallel": slots_source,
                   "context_tokens": "backend.context" if b.context else
                   f"derived: {PROMPT_SLACK:g} x prompt + output + {CONTEXT_PAD}"}
        env = {
            "OLLAMA_KV_CACHE_TYPE": self.kv_type,
            "OLLAMA_FLASH_ATTENTION": "1" if b.flash_attention else "0",
            "OLLAMA_NUM_PARALLEL": str(slots),
            "OLLAMA_CONTEXT_LENGTH": str(context),
            "OLLAMA_HOST": _host_port(b.host, b.port or PORT),  # type: ignore[arg-type]
            **own_folders(self.imports),
            **b.env,
        }
        argv = [self.program or "ollama", "serve", *b.extra_args]
        return self._make_spec(argv, env, slots=slots, context=context, per_seq=context, sources=sources,
                               capabilities=replace(self.capabilities, offline_tokenizer=self.imports is not None))

    def _options(self, max_tokens: Optional[int] = None) -> dict[str, Any]:
        # num_ctx equals OLLAMA_CONTEXT_LENGTH, so a launched server does not reload the model; on an
        # attached server it makes the loaded context big enough (one reload, at the first request).
        opts: dict[str, Any] = {"temperature": 0, "num_ctx": self.context}
        if not self.b.endpoint or self.b.threads:  # an attached server keeps its own unless asked
            opts["num_thread"] = self.threads
        if max_tokens is not None:
            opts["num_predict"] = max_tokens
        return opts

    def request(self, prompt: Any, max_tokens: int, api: str, cache: bool = False) -> Request:
        body: dict[str, Any] = {"model": self.model_tag, "stream": True, "truncate": False,
                                "options": self._options(max_tokens)}
        if api == "chat" and (isinstance(prompt, str) or prompt and isinstance(prompt[0], dict)):
            body["messages"] = openai.chat_messages(prompt)
            return Request("/api/chat", body)
        if not isinstance(prompt, str):
            raise BackendError("ollama: token-id prompts are not supported (no tokenizer endpoint); send text")
        if api != "completions":
            raise BackendError(f"ollama: unknown api {api!r} (completions | chat)")
        # raw: no chat template, so the prompt the server counts is the text sent (and no `context`
        # token list is tokenized and returned at the end)
        body["prompt"] = prompt
        body["raw"] = True
        return Request("/api/generate", body)

    def parse_line(self, line: bytes) -> Optional[StreamEvent]:
        return parse_ndjson_line(line)

    def unfinished_stream(self, repeats: int) -> Optional[str]:
        """Ollama ends a reply without its final object, and logs it only at debug level, once the same
        token text has come REPEAT_LIMIT + 1 times in a row (llm/server.go, Completion: "prediction
        aborted, token repeat limit reached")."""
        if repeats < REPEAT_LIMIT:
            return None
        return (f"the same token came {repeats + 1} times in a row and Ollama stops a reply at the next one "
                "(its token repeat limit, llm/server.go): the model looped at temperature 0")

    async def version(self, session: aiohttp.ClientSession) -> Optional[str]:
        return await reported_version(session, self.base_url + "/api/version", "version")

    async def import_model(self, session: aiohttp.ClientSession) -> None:
        """Import the job's GGUF as self.model_tag through the server's API: the file is sent only when
        the server does not hold its digest yet, then /api/create makes the tag (milliseconds)."""
        gguf = self.imports
        assert gguf is not None
        if self._digest is None:  # once per job (a cache reset imports again): ~0.3 s per 100 MB, off the loop
            self._digest = "sha256:" + await asyncio.to_thread(_digest, gguf)
        digest = self._digest
        blob = f"{self.base_url}/api/blobs/{digest}"
        async with session.head(blob) as r:
            held = r.status == 200
        if not held:
            with open(gguf, "rb") as f:  # aiohttp reads a file payload in its executor
                async with session.post(blob, data=f) as r:
                    if r.status not in (200, 201):
                        raise BackendError(f"ollama: sending {gguf} to the server failed: HTTP {r.status}: "
                                           f"{_error_text(await r.text())}")
        body = {"model": self.model_tag, "files": {_gguf_name(gguf): digest}, "stream": False}
        async with session.post(self.base_url + "/api/create", json=body) as r:
            text = await r.text()
        if r.status != 200:
            raise BackendError(f"ollama: importing {gguf} as {self.model_tag} failed: HTTP {r.status}: "
                               f"{_error_text(text)}")

    async def chars_per_token(self, session: aiohttp.ClientSession) -> Optional[tuple[float, int, int]]:
        """One probe: estimated text half the context long at one character per token (it fits whatever
        the tokenizer), raw, one output token; the server's prompt_eval_count gives the ratio."""
        chars = max(16, min(PROBE_CHARS, self.context // 2))
        text = prompts.estimated_text(1, chars, seed=PROBE_SEED, chars_per_token=1.0)[0]
        counted = await self.prompt_tokens(session, text, "completions")
        return len(text) / counted, len(text), counted

    async def prompt_tokens(self, session: aiohttp.ClientSession, text: str, api: str) -> int:
        """The server's prompt_eval_count for `text` sent as a request of `api` (one output token)."""
        req = self.request(text, 1, api)
        async with session.post(self.base_url + req.path, json={**req.body, "stream": False}) as r:
            reply = await r.text()
        try:
            counted = _count(json.loads(reply), "prompt_eval_count") if r.status == 200 else None
        except (ValueError, AttributeError):
            counted = None
        if not counted:
            raise BackendError(f"ollama: counting a probe prompt's tokens failed: HTTP {r.status}: "
                               f"{_error_text(reply)}")
        return counted

    async def text_units(self, session: aiohttp.ClientSession, api: str, seed: int,
                         log_dir: Path) -> Union[prompts.TextUnits, str, None]:
        gguf = self.imports
        if gguf is None:
            return f"model.ollama={self.model_tag}: a tag the server holds, whose vocabulary kvexp does not read"
        return await gguf_tokenizer.exact_units(gguf, api, seed, log_dir,
                                                lambda text, a: self.prompt_tokens(session, text, a))

    def log_states_kv(self, log_text: str) -> bool:
        return LOADED_LINE in log_text

    log_kept = r'msg="(?:starting runner|llama runner process no longer running)"'  # what model_lost reads

    def model_lost(self, log_part: str) -> Optional[str]:
        if m := _RUNNER_GONE.search(log_part):
            return f'Ollama\'s runner died ("{m[1]}", {m[2]}) and the model was loaded again'
        return ("Ollama started its model runner again: the model was loaded again"
                if _RUNNER_START.search(log_part) else None)

    async def preload(self, session: aiohttp.ClientSession) -> bool:
        """Load the model (an empty prompt, as Ollama documents) so that the load lands neither in
        the first request's TTFT nor after the KV lines are read from the log. The reply carries no
        durations (done_reason "load" only): time the call if the load time is wanted."""
        if self.imports:
            await self.import_model(session)
        body = {"model": self.model_tag, "prompt": "", "stream": False, "options": self._options()}
        async with session.post(self.base_url + "/api/generate", json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise BackendError(f"ollama: loading {self.model_tag} failed: HTTP {r.status}: "
                                   f"{_error_text(text)}" + _pull_hint(r.status, self.model_tag))
        try:
            done = json.loads(text).get("done")
        except (ValueError, AttributeError):
            done = None
        if done is not True:
            raise BackendError(f"ollama: loading {self.model_tag}: unexpected reply {text[:80]!r}")
        return True

    async def reset_cache(self, session: aiohttp.ClientSession) -> Optional[str]:
        """Ollama has no cache-reset call: the model is unloaded (keep_alive 0) and loaded again, so the
        next level starts on a new runner whose prompt cache is empty."""
        body = {"model": self.model_tag, "keep_alive": 0, "stream": False}
        async with session.post(self.base_url + "/api/generate", json=body) as r:
            if r.status != 200:
                raise BackendError(f"ollama: unloading {self.model_tag} answered HTTP {r.status}: "
                                   f"{_error_text(await r.text())}")
        for _ in range(UNLOAD_POLLS):  # the scheduler unloads after answering
            if not any(m["name"] == self.model_tag or str(m["name"]).startswith(self.model_tag + ":")
                       for m in await self.loaded_models(session)):
                break
            await asyncio.sleep(0.1)
        else:
            raise BackendError(f"ollama: {self.model_tag} was still loaded {UNLOAD_POLLS / 10:g} s after keep_alive=0")
        await self.preload(session)
        return "unloaded the model (keep_alive 0) and loaded it again: a new runner, its prompt cache empty"

    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo:
        return parse_server_log(log_text, self.kv_type)

    continuation_unit = "character"  # no token ids in its answers

    def continuation_request(self, prompt: Any, max_tokens: int, top_k: int, seed: int) -> Optional[Request]:
        req = self.request(prompt, max_tokens, "completions")
        body = {**req.body, "stream": False}
        body["options"] = {**body.get("options", {}), "temperature": 0, "seed": seed}
        return Request(req.path, body)

    def parse_continuation(self, data: dict[str, Any]) -> tuple[list[Any], list[Optional[dict[int, float]]]]:
        text = data.get("response") or ""
        return list(text), [None] * len(text)

    server_timing_source = "Ollama's per-request durations (TPOT = eval_duration / (eval_count - 1))"

    def request_timing(self, timings: Optional[dict[str, float]],
                       output_tokens: Optional[int]) -> Optional[dict[str, Optional[float]]]:
        """Ollama's runners (runner/llamarunner and runner/ollamarunner) count the first token's decode in
        prompt_eval_duration and time eval_duration from the first token to the last: eval_count tokens,
        eval_count - 1 intervals, which is what the client's TPOT averages too."""
        if not timings:
            return None
        decode = timings.get("eval_s")
        return {"tpot_s": decode / (output_tokens - 1) if decode is not None and output_tokens and output_tokens > 1
                else None,
                "prefill_s": timings.get("prompt_eval_s"), "cached_tokens": None}

    async def loaded_models(self, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        """/api/ps: each loaded model's name, size and size_vram (bytes; the server's own accounting
        of weights + KV cache + buffers) and context_length (per sequence; None on older servers)."""
        async with session.get(self.base_url + "/api/ps") as r:
            if r.status != 200:
                raise BackendError(f"ollama: /api/ps answered HTTP {r.status}")
            models = (await answer_json(r)).get("models") or []
        if not (isinstance(models, list) and all(isinstance(m, dict) for m in models)):
            raise BackendError(f"ollama: /api/ps answered models that are not a list of objects: {str(models)[:80]}")
        out = []
        for m in models:
            out.append({"name": m.get("name") or m.get("model"), "size": _count(m, "size"),
                        "size_vram": _count(m, "size_vram"), "context_length": _count(m, "context_length")})
        return out


def models_dir() -> Path:
    """The models folder of the servers kvexp launches to serve a GGUF it imports."""
    return cache_dir() / "ollama" / "models"


def own_folders(imports: bool) -> dict[str, str]:
    """A launched Ollama keeps to kvexp's folders and off the network: HOME is kvexp's (`serve` writes its key
    pair to $HOME/.ollama, cmd.initializeKeypair), its cloud is off (OLLAMA_NO_CLOUD=1: no remote models, no
    fetch of model recommendations at start; v0.24.0's `serve` has no update check), and its models folder is
    kvexp's for an imported GGUF, else the user's own (OLLAMA_MODELS, else ~/.ollama/models)."""
    models = models_dir() if imports else Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")
    return {"HOME": str(cache_dir() / "ollama" / "home"), "OLLAMA_NO_CLOUD": "1", "OLLAMA_MODELS": str(models)}


def _digest(gguf: Path) -> str:
    """The file's sha256: the embedded models' pinned one when the file is theirs (same size), else read."""
    for m in embedded.WHEEL_MODELS.values():
        if gguf == m.gguf and gguf.stat().st_size == m.size:
            return m.sha256
    return sha256_of(gguf)


def _gguf_name(gguf: Path) -> str:
    """The file's name as /api/create is given it: ending in .gguf, which Ollama takes as the format."""
    return gguf.name if gguf.name.endswith(".gguf") else gguf.name + ".gguf"


def _host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _error_text(body: str) -> str:
    try:
        data = json.loads(body)
        if isinstance(data, dict) and "error" in data:
            return str(data["error"])
    except ValueError:
        pass
    return body.strip()[:200]


def _pull_hint(status: int, tag: str) -> str:
    return f" (pull it first: ollama pull {tag})" if status == 404 and not tag.startswith(TAG_PREFIX) else ""
