"""Settings: every limit, timeout and address, read from TASKGATE_* environment variables."""

from __future__ import annotations

import base64
import binascii
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from taskgate import families

# Keyword arguments taskgate itself passes to a pipeline call; pipeline_options may not override them.
RESERVED_CALL_OPTIONS = frozenset({
    "prompt", "negative_prompt", "num_frames", "height", "width", "num_inference_steps", "guidance_scale", "frame_rate",
    "generator", "output_type", "return_dict", "latents", "callback_on_step_end", "callback", "callback_steps", "image",
})


class ModelSpec(BaseModel):
    """One entry of the model registry: where the pipeline lives, what requests it accepts and how it sits on a GPU."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(
        default=None,
        description="Folder holding a diffusers pipeline (save_pretrained), or for 'transformers' a causal LM with its "
        "tokenizer.",
    )
    kind: Literal["diffusers", "sleep", "transformers", "openai-compatible", "python"] = Field(
        default="diffusers",
        description="'sleep' holds a slot without a GPU; 'transformers' runs chat tasks on an in-process causal LM; "
        "'openai-compatible' forwards chat tasks to an OpenAI-compatible server at base_url; 'python' runs a runner of "
        "your own that factory makes.",
    )
    factory: str | None = Field(
        default=None,
        description="'python' kind: 'module:callable' the worker imports and calls as callable(model_id, spec, device) "
        "for each device the model may use, getting a runner (render and encode, see services/worker/runtypes.py); it "
        "needs no GPU unless another model of the worker does.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="'python' kind: the factory's own options (JSON), which it reads from spec.options.",
    )
    pipeline: str | None = Field(
        default=None,
        description="diffusers pipeline class (model_index.json's _class_name); its family fills the limits and "
        "defaults left out.",
    )
    sleep_seconds: float = Field(default=0.0, ge=0, description="How long a 'sleep' model runs.")
    task_types: list[str] = Field(
        default_factory=lambda: ["text-to-video"],
        description="Task types this model serves (a 'transformers' model: chat).",
    )
    max_sequences: int = Field(
        default=8,
        ge=1,
        description="Chat models: sequences generated at once on one loaded model (continuous batching).",
    )
    max_input_tokens: int = Field(
        default=4096,
        ge=1,
        description="Chat models: most tokens of a request's input, counted with the model's tokenizer at admission.",
    )
    max_output_tokens: int = Field(
        default=2048, ge=1, description="Chat models: largest max_output_tokens a request may ask for."
    )
    default_max_output_tokens: int = Field(
        default=256, ge=1, description="Chat models: max_output_tokens when a request gives none."
    )
    default_temperature: float = Field(
        default=1.0, ge=0, le=2, description="Chat models: temperature when a request gives none."
    )
    default_top_p: float = Field(default=1.0, gt=0, le=1, description="Chat models: top_p when a request gives none.")
    tokenizer: Path | None = Field(
        default=None,
        description="Chat models: the folder (or tokenizer.json) the gateway counts input tokens with; default: path.",
    )
    max_frames: int = Field(default=81, ge=1, description="Most frames a request may ask for.")
    frame_step: int = Field(default=4, ge=1, description="num_frames - 1 must be a multiple of this.")
    max_width: int = Field(default=1280, ge=16, description="Widest frame, pixels.")
    max_height: int = Field(default=1280, ge=16, description="Tallest frame, pixels.")
    size_multiple: int = Field(default=16, ge=1, description="Width and height must be multiples of this.")
    max_steps: int = Field(default=100, ge=1, description="Most denoising steps.")
    max_guidance: float = Field(default=30.0, ge=0, description="Largest guidance scale.")
    default_frames: int = Field(default=9, description="Frames when a request gives none.")
    default_width: int = Field(default=32, description="Width when a request gives none.")
    default_height: int = Field(default=32, description="Height when a request gives none.")
    default_steps: int = Field(default=4, description="Steps when a request gives none.")
    default_guidance: float = Field(default=5.0, description="Guidance scale when a request gives none.")
    default_fps: int = Field(default=8, description="Frames per second of the MP4 when a request gives none.")
    negative_prompt: bool = Field(default=True, description="Whether a request may carry a negative prompt.")
    image_fit: Literal["crop", "resize", "pad"] = Field(
        default="crop",
        description="How an input image is fitted to the requested frame size: crop (cover, cut the centre), "
        "resize (stretch) or pad (fit inside, black bars).",
    )
    max_image_width: int = Field(
        default=4096, ge=16, description="Widest input image of an image-to-video request, pixels."
    )
    max_image_height: int = Field(
        default=4096, ge=16, description="Tallest input image of an image-to-video request, pixels."
    )
    max_image_bytes: int = Field(default=10 * 1024 * 1024, ge=1, description="Largest input image file as sent, bytes.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Weights' dtype; auto = bfloat16 on CUDA (float16 without bf16), float32 on CPU."
    )
    offload: Literal["none", "model", "sequential"] = Field(
        default="none",
        description="CPU offload on CUDA: whole components (model) or layer by layer (sequential, slowest).",
    )
    allow_pickle_weights: bool = Field(
        default=False, description="Also load .bin/.pt weights (pickle runs code on load); default: safetensors only."
    )
    vae_tiling: bool = Field(default=False, description="Decode the video in tiles: less GPU memory at large sizes.")
    vae_slicing: bool = Field(default=False, description="Decode batch entries one at a time.")
    attention_backend: str | None = Field(
        default=None,
        description="diffusers attention backend of the transformer ('flash', 'sage', '_native_cudnn', ...).",
    )
    torch_compile: Literal["off", "transformer", "blocks"] = Field(
        default="off",
        description="torch.compile the whole transformer, or its repeated blocks (faster to compile); warmed up at "
        "start.",
    )
    compile_mode: str | None = Field(default=None, description="torch.compile mode, e.g. 'max-autotune-no-cudagraphs'.")
    compile_backend: str = Field(
        default="inductor",
        description="torch.compile backend; 'eager' traces without making kernels (checks, not speed).",
    )
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="CUDA device indices this model may run on; unset = every GPU of the worker."
    )
    pipeline_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra keyword arguments of every pipeline call, e.g. {'decode_timestep': 0.05}.",
    )
    max_concurrency: int = Field(
        default=0, ge=0, description="Running tasks of this model across all workers; 0 = no cap."
    )
    checkpoint_every_seconds: float = Field(
        default=30.0, ge=0,
        description="A step checkpoint (resumed by a later attempt) every this many device seconds of a run; 0 = not "
        "by time.",
    )
    preempt_after_seconds: float | None = Field(
        default=None, gt=0,
        description="Opt-in: a task queued this long at a higher priority, not yet running, makes the scheduler "
        "preempt this model's lowest-priority run with the most steps left (checkpointed at its next step, released, "
        "resumed later); never when checkpoints are off. Unset = never.",
    )
    checkpoint_every_steps: int = Field(
        default=0,
        ge=0,
        description="A step checkpoint every this many steps; 0 = not by steps (both 0: checkpoints off).",
    )
    preview_every_fraction: float = Field(
        default=0.0, ge=0, le=1,
        description="A preview image of the running video each time this fraction of its steps is done (0.1: ten per "
        "run), from the latents by a linear projection (no VAE pass); 0 = not by steps (both 0: no previews).",
    )
    preview_every_seconds: float = Field(
        default=0.0, ge=0, description="A preview image every this many seconds of a run's denoising; 0 = not by time."
    )
    preview_size: int = Field(
        default=128, ge=8, le=1024, description="A preview frame's longer side in pixels (the video's aspect kept)."
    )
    preview_frames: int = Field(
        default=4,
        ge=1,
        le=16,
        description="How many of the video's frames, evenly spaced, a preview shows side by side.",
    )
    preview_format: Literal["webp", "png"] = Field(default="webp", description="The preview images' format.")
    preview_rgb_factors: list[Annotated[list[float], Field(min_length=3, max_length=3)]] | None = Field(
        default=None,
        description="The latent-to-RGB projection: one [r, g, b] row per latent channel (the family's fitted factors); "
        "unset = the channels in three groups, each image stretched to its own range.",
    )
    preview_rgb_bias: Annotated[list[float], Field(min_length=3, max_length=3)] | None = Field(
        default=None, description="Added to preview_rgb_factors' projection (r, g, b), whose result is read in [-1, 1]."
    )
    base_url: str | None = Field(
        default=None,
        description="'openai-compatible' kind: the upstream server's API root, e.g. http://vllm:8000/v1 (vLLM, SGLang, "
        "TGI, llama.cpp's server, Ollama).",
    )
    upstream_model: str | None = Field(
        default=None,
        description="'openai-compatible' kind: the model name the upstream serves; unset = this entry's id.",
    )
    api_key_env: str | None = Field(
        default=None,
        description="'openai-compatible' kind: the environment variable holding the upstream's API key (a secret, "
        "never the registry); unset = no key.",
    )
    upstream_max_requests: int = Field(
        default=4,
        ge=1,
        description="'openai-compatible' kind: most requests one worker has open to this upstream at once.",
    )
    upstream_connect_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="'openai-compatible' kind: how long connecting to the upstream may take (then a retryable "
        "failure).",
    )
    upstream_read_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="'openai-compatible' kind: the longest wait for the upstream's next streamed chunk, the first one "
        "included (then a retryable failure).",
    )
    upstream_extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="'openai-compatible' kind: extra fields of every request, the server's own options (e.g. vLLM's "
        "top_k, min_tokens); a task's own parameters win.",
    )
    upstream_stream_usage: bool = Field(
        default=True,
        description="'openai-compatible' kind: ask for token usage in the stream's last chunk "
        "(stream_options.include_usage); without it, or from a server that sends none, output tokens are counted as "
        "streamed.",
    )
    gpu_seconds_estimate: float = Field(
        default=60.0, ge=0,
        description="GPU-seconds a task is reserved of a budgeted tenant's budget when its model has no recent metered "
        "runs.",
    )
    queue_timeout_seconds: float | None = Field(default=None, gt=0, description="Overrides the global queue timeout.")
    processing_timeout_seconds: float | None = Field(
        default=None, gt=0, description="Overrides the global processing timeout."
    )

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """Fills the limits and defaults an entry leaves out from its pipeline's family."""
        if isinstance(data, dict):
            if data.get("kind") in ("transformers", "openai-compatible") and "task_types" not in data:
                data = {**data, "task_types": ["chat"]}
            family = families.family_of(data.get("pipeline"))
            if family is not None:
                return {**family.spec_defaults(), **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.kind == "openai-compatible" and not self.base_url:
            raise ValueError("an 'openai-compatible' model needs base_url")
        if self.kind == "python" and (not self.factory or not all(self.factory.partition(":")[::2])):
            raise ValueError("a 'python' model needs factory as 'module:callable'")
        if not 1 <= self.default_frames <= self.max_frames or (self.default_frames - 1) % self.frame_step:
            raise ValueError(
                f"default_frames {self.default_frames} breaks max_frames {self.max_frames} / frame_step "
                f"{self.frame_step}"
            )
        for name, value, limit in (("default_width", self.default_width, self.max_width),
                                   ("default_height", self.default_height, self.max_height)):
            if not 1 <= value <= limit or value % self.size_multiple:
                raise ValueError(
                    f"{name} {value} is not a multiple of size_multiple {self.size_multiple} up to {limit}"
                )
        if not 1 <= self.default_steps <= self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} is not 1..max_steps {self.max_steps}")
        if not 0 <= self.default_guidance <= self.max_guidance:
            raise ValueError(f"default_guidance {self.default_guidance} is not 0..max_guidance {self.max_guidance}")
        family = families.family_of(self.pipeline)
        if family is not None and self.attention_backend is not None and not family.attention_backends:
            raise ValueError(f"{self.pipeline}'s attention does not honour attention_backend")
        if family is not None and self.torch_compile == "blocks" and not family.repeated_blocks:
            raise ValueError(f"{self.pipeline} declares no repeated blocks: use torch_compile 'transformer'")
        if self.default_max_output_tokens > self.max_output_tokens:
            raise ValueError(
                f"default_max_output_tokens {self.default_max_output_tokens} is above max_output_tokens "
                f"{self.max_output_tokens}"
            )
        clash = sorted(RESERVED_CALL_OPTIONS & set(self.pipeline_options))
        if clash:
            raise ValueError(f"pipeline_options may not set {', '.join(clash)}: taskgate passes them")
        return self


InputFormat = Literal["PNG", "JPEG", "WEBP"]
INPUT_FORMATS: tuple[InputFormat, ...] = ("PNG", "JPEG", "WEBP")  # Pillow's names: what an input image may arrive as

# Request defaults of the tiny local models: a few frames at thumbnail size, quick on a CPU.
TINY_DEFAULTS: dict[str, Any] = {
    "default_frames": 9,
    "default_width": 32,
    "default_height": 32,
    "default_steps": 4,
    "default_guidance": 5.0,
    "default_fps": 8,
}


class CommonSettings(BaseSettings):
    """What every process reads (and what more than one service reads). Each field is the env var TASKGATE_<FIELD
    NAME>."""

    model_config = SettingsConfigDict(env_prefix="TASKGATE_", extra="ignore")

    # Where things are
    database_url: str | None = Field(
        default=None, description="PostgreSQL URL; unset = embedded server under state_dir."
    )
    nats_url: str | None = Field(
        default=None,
        description="NATS URL, or a cluster's server URLs comma-separated; unset = embedded nats-server under "
        "state_dir.",
    )
    nats_tls_ca_file: Path | None = Field(
        default=None,
        description="CA that signed the NATS servers' certificates (TLS on; tls:// URLs alone use the system CAs).",
    )
    setup_on_start: bool = Field(
        default=True,
        description="Each service applies migrations and declares the NATS streams as it starts; false: only "
        "`python -m taskgate.migrate` does, with the owner credentials (least privilege: the manifests).",
    )
    state_dir: Path = Field(
        default=Path(".taskgate"), description="Local state folder (embedded servers, models, results)."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level of the JSON logs."
    )
    db_pool_size: int = Field(default=10, ge=1, le=200, description="asyncpg pool size per process.")
    health_check_seconds: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="How often a service re-checks PostgreSQL and NATS for its readiness probe.",
    )
    health_check_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        le=30,
        description="A readiness check's PostgreSQL round trip longer than this counts as down.",
    )
    startup_connect_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Start-up: how long a service retries its first connections to PostgreSQL and NATS (backoff, a log "
        "line per attempt) before it exits.",
    )
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="Replicas of each JetStream stream (3 in a 3-node NATS cluster)."
    )
    output_max_age_seconds: float = Field(
        default=86400.0,
        gt=0,
        description="How long a task's partial output (text deltas, previews, log lines) stays in the TASK_OUTPUT "
        "stream for streams to resume from; the finished result itself is kept by the result store's retention.",
    )

    # gRPC endpoints (each service's own port, and how the others reach it) and TLS
    grpc_host: str = Field(default="127.0.0.1", description="Address the gRPC servers bind ('0.0.0.0' in a cluster).")
    submit_port: int = Field(
        default=50051, ge=0, le=65535, description="gRPC port of the submit service (TaskGateway); 0 = ephemeral."
    )
    notifier_port: int = Field(default=50052, ge=0, le=65535, description="gRPC port of the notifier (TaskEvents).")
    scheduler_port: int = Field(default=50053, ge=0, le=65535, description="gRPC port of the scheduler (TaskAdmin).")
    worker_port: int = Field(default=50054, ge=0, le=65535, description="gRPC port of a worker (WorkerControl).")
    metrics_host: str = Field(default="127.0.0.1", description="Address the /metrics endpoints bind.")
    tls_cert_file: Path | None = Field(default=None, description="Server certificate (PEM); enables TLS.")
    tls_key_file: Path | None = Field(default=None, description="Server private key (PEM).")
    tls_client_ca_file: Path | None = Field(default=None, description="CA for client certificates; enables mutual TLS.")
    grpc_allow_plaintext: bool = Field(
        default=False,
        description="Serve gRPC without TLS on a non-loopback grpc_host (only where the network itself is trusted or "
        "encrypted).",
    )
    grpc_health_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Also serve the health service alone, in plaintext, on this port (kubelet's gRPC probes speak no "
        "TLS).",
    )
    tls_ca_file: Path | None = Field(
        default=None,
        description="CA the services verify each other's gRPC certificates with; set: internal calls use TLS.",
    )
    grpc_max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted.")
    grpc_max_connection_age_seconds: float = Field(
        default=300.0,
        gt=0,
        description="A client connection is closed (GOAWAY) after this long, so clients re-resolve and reach new pods.",
    )
    grpc_max_connection_age_grace_seconds: float = Field(
        default=30.0, ge=0, description="Time calls on a connection closed for its age get to finish."
    )
    grpc_min_ping_interval_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Most frequent keepalive ping accepted from a client (the SDK pings every 30 s).",
    )
    stream_keepalive_seconds: float = Field(
        default=15.0, gt=0, description="Keep-alive period on idle WatchTask/WatchTasks streams."
    )
    stream_max_age_seconds: float = Field(
        default=300.0, gt=0,
        description="A WatchTask/WatchTasks stream ends after this long (90-100%) with UNAVAILABLE and where to "
        "resume; the servers' connection grace is raised to cover it, so no stream is cut off by a connection's age "
        "without a status.",
    )

    # Authentication and callers' limits (every gRPC service)
    api_key_pepper: str = Field(
        default="taskgate-dev-pepper", min_length=8, description="Secret mixed into API-key hashes."
    )
    api_key_cache_seconds: float = Field(
        default=5.0, ge=0,
        description="How long a service trusts a key's looked-up answer; a revocation reaches it sooner "
        "(LISTEN/NOTIFY).",
    )
    secrets_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Fernet keys sealing webhook secrets at rest, newest first (the first seals, each opens); "
        "empty: one derived from api_key_pepper.",
    )
    tenant_calls_per_second: float = Field(
        default=100.0, ge=0,
        description="RPCs a tenant may make per second on each process (paced: a call past it waits its turn); 0 = no "
        "limit."
    )
    tenant_calls_burst: int = Field(
        default=20, ge=1, description="Calls a tenant may make at once before its rate applies."
    )
    tenant_calls_wait_seconds: float = Field(
        default=2.0, ge=0,
        description="How long a call past its tenant's rate waits for its turn; one that would wait longer is refused "
        "RESOURCE_EXHAUSTED TENANT_RATE_LIMITED.",
    )
    tenant_calls_in_flight: int = Field(
        default=1, ge=0,
        description="Unary calls of one tenant a process runs at once; its further calls wait behind them, in its own "
        "line (0 = no cap). 1: on one event loop each running call of a tenant puts its steps in front of every other "
        "tenant's; a GetTask takes a few ms, so one place still serves a tenant's whole call rate.",
    )
    process_calls_in_flight: int = Field(
        default=16, ge=0,
        description="Unary calls a process runs at once over all tenants; further calls wait, the waiting tenants "
        "served in turn (0 = no cap).",
    )
    tenant_calls_waiting: int = Field(
        default=1000, ge=1,
        description="Calls of one tenant that may wait for a place on a process; more are refused RESOURCE_EXHAUSTED "
        "TENANT_RATE_LIMITED.",
    )
    max_streams_per_tenant: int = Field(
        default=100, ge=1, description="WatchTask/WatchTasks streams a tenant may hold open per process."
    )
    max_streams_per_process: int = Field(default=10000, ge=1, description="Streams one notifier holds open in all.")

    # Models and tasks (the registry, leases, limits more than one service applies)
    default_model: str = Field(default="wan-tiny", description="Model used when a request names none.")
    models: dict[str, ModelSpec] = Field(
        default_factory=dict,
        description="Model registry as JSON; default: wan-tiny, ltx-i2v-tiny and llama-tiny (chat) under state_dir.",
    )
    lease_seconds: float = Field(default=10.0, gt=0, description="A claim's lease; also the JetStream ack wait.")
    queue_timeout_seconds: float = Field(
        default=180.0, gt=0,
        description="QUEUED longer than this at a model whose queue does not move (no claim within it, nothing "
        "running): missing messages re-published, then TIMEOUT.",
    )
    max_worker_losses: int = Field(
        default=2, ge=1,
        description="Attempts of one task whose worker was lost (lease expired) while it held no other task, before "
        "the task is FAILED WORKER_LOST (a loss in company is counted apart; a task runs alone after any loss).",
    )
    max_input_chars: int = Field(
        default=2 * 1024 * 1024, ge=1,
        description="Chat tasks: most characters of a request's input (its messages together; the model's "
        "max_input_tokens also applies).",
    )
    input_max_bytes: int = Field(
        default=20 * 1024 * 1024,
        ge=1,
        description="Largest input image UploadInput stores or the gateway fetches from a URL.",
    )
    callback_allow_hosts: list[str] = Field(
        default_factory=list, description="Hosts exempt from the SSRF guard, e.g. ['127.0.0.1']."
    )
    submit_publish_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        description="Wait for JetStream's acks of one dispatcher pass; on timeout its tasks stay CREATED.",
    )
    submit_db_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description="Cap on each database call of the submit service (a batch's own, whatever its callers' deadlines).",
    )
    id_node_lease_seconds: float = Field(
        default=60.0,
        ge=1,
        description="Lease of a submit replica's task id node number (renewed four times per lease).",
    )

    # Result store
    result_store: Literal["objectstore", "fs", "s3"] = Field(
        default="objectstore", description="JetStream object store, a folder (fs), or an S3-compatible bucket (s3)."
    )
    result_dir: Path | None = Field(default=None, description="Folder for result_store=fs; default state_dir/results.")
    result_stall_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A result store read that receives nothing for this long fails (retryable) instead of waiting on.",
    )
    s3_bucket: str = Field(default="taskgate-results", description="Bucket of result_store=s3 (it must exist).")
    s3_prefix: str = Field(default="results/", description="Key prefix of outputs in the bucket.")
    s3_endpoint_url: str | None = Field(default=None, description="S3 API endpoint; unset = AWS for s3_region.")
    s3_public_endpoint_url: str | None = Field(
        default=None, description="Endpoint written into download URLs, when receivers reach S3 by another address."
    )
    s3_region: str = Field(default="us-east-1", description="Region the requests are signed for.")
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="Bucket in the path or in the host name ('path' for most self-hosted servers)."
    )
    s3_access_key_id: str | None = Field(
        default=None, description="Access key; unset = the AWS default chain (env, role)."
    )
    s3_secret_access_key: str | None = Field(default=None, description="Secret key (from a Secret in a cluster).")
    result_url_ttl_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=604800,
        description="Lifetime of a result_url (presigned GET; S3 allows 7 days at most).",
    )

    # ETA (GetTask, WatchTask, progress webhooks)
    eta_history_seconds: float = Field(
        default=86400.0,
        gt=0,
        description="How far back an ETA looks for its model's successful runs of the task's size class.",
    )
    eta_history_runs: int = Field(
        default=20, ge=1, le=1000, description="Latest successful runs whose median run time an ETA uses."
    )
    priority_weights: tuple[int, int, int] = Field(default=(6, 3, 1), description="Fetch weights HIGH, NORMAL, LOW.")
    eta_snapshot_seconds: float = Field(
        default=1.0, ge=0,
        description="How old the queue snapshot a process (gateway, notifier) answers queue positions and ETAs from "
        "may be before it is read again (every poll of a level shares it; 0: read for every poll).",
    )

    @field_validator("secrets_keys")
    @classmethod
    def _fernet_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        """Each key is a Fernet key: 32 bytes in URL-safe base64 (`python -c 'from cryptography.fernet import Fernet;
        print(Fernet.generate_key().decode())'`)."""
        for key in keys:
            try:
                raw = base64.urlsafe_b64decode(key.get_secret_value().encode())
            except (ValueError, binascii.Error):
                raw = b""
            if len(raw) != 32:
                raise ValueError("each secrets key is 32 bytes in URL-safe base64 (a Fernet key)")
        return keys

    @model_validator(mode="after")
    def _check_common(self) -> CommonSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("s3_access_key_id and s3_secret_access_key go together")
        if not self.models:
            self.models = {  # the tiny local models (taskgate_local.tinymodel builds them): text- and image-to-video
                name: ModelSpec(path=self.state_dir / "models" / name, pipeline=pipeline, **TINY_DEFAULTS)
                for name, pipeline in (("wan-tiny", "WanPipeline"), ("ltx-i2v-tiny", "LTXImageToVideoPipeline"))
            }
            # the tiny chat model (taskgate_local.tinylm): a few hundred tokens of random text, quick on a CPU
            self.models["llama-tiny"] = ModelSpec(
                kind="transformers",
                path=self.state_dir / "models" / "llama-tiny",
                max_sequences=8,
                max_input_tokens=4096,
                max_output_tokens=1024,
                default_max_output_tokens=64,
            )
        if self.default_model not in self.models:
            raise ValueError(f"default_model {self.default_model!r} is not in models")
        return self

    @property
    def ack_wait_seconds(self) -> float:
        """JetStream ack wait, derived from the lease so the two never disagree."""
        return self.lease_seconds

    def queue_timeout_for(self, model_id: str) -> float:
        spec = self.models.get(model_id)
        return (spec.queue_timeout_seconds if spec else None) or self.queue_timeout_seconds


class GatewaySettings(CommonSettings):
    """The gateway (services.submit: TaskGateway): admission limits, inputs, batches, task ids."""

    submit_metrics_port: int = Field(default=9101, ge=0, le=65535, description="0 disables /metrics.")
    max_retries: int = Field(default=3, ge=0, description="Default retries of retryable failures.")
    client_token_max_overlap_seconds: float = Field(
        default=7 * 86400.0, ge=0,
        description="Longest a tenant's rotated-out client-token secret keeps its tokens valid (the overlap it asks "
        "for).",
    )
    webhook_secret_max_overlap_seconds: float = Field(
        default=7 * 86400.0,
        ge=0,
        description="Longest overlap a tenant may ask for when it rotates its own webhook secret.",
    )
    max_pending_per_tenant: int = Field(
        default=100, ge=1, description="Unfinished tasks a tenant may hold, its end users' together."
    )
    submits_per_minute: int = Field(
        default=600, ge=1, description="Submissions a tenant may make per minute, its end users' together."
    )
    max_pending_per_end_user: int = Field(
        default=3, ge=1, description="Unfinished tasks one end user of a tenant may hold (inside the tenant's limit)."
    )
    submits_per_minute_per_end_user: int = Field(
        default=30, ge=1, description="Submissions one end user of a tenant may make per minute (inside the tenant's)."
    )
    max_prompt_chars: int = Field(default=2000, ge=1, description="Longest prompt accepted, in characters.")
    max_stop_sequences: int = Field(default=4, ge=0, description="Chat tasks: most stop strings a request may give.")
    max_metadata_bytes: int = Field(default=4096, ge=0, description="Size of the metadata map as JSON.")
    result_cache_size: int = Field(
        default=10000, ge=0, description="Terminal tasks kept in the submit service's cache."
    )
    result_cache_seconds: float = Field(
        default=300.0, gt=0,
        description="How long the submit service's cache keeps a terminal task (deletions also reach it by NOTIFY).",
    )
    max_fps: int = Field(default=60, ge=1, description="Largest frames-per-second a request may ask for.")
    max_task_retries: int = Field(default=10, ge=0, description="Largest max_retries a request may ask for.")
    max_start_delay_seconds: float = Field(
        default=7 * 86400.0, ge=0, description="Furthest ahead a request's start_after may be, in seconds."
    )
    max_queue_ttl_seconds: float = Field(
        default=7 * 86400.0, gt=0, description="Largest max_queue_seconds (a request's own queue TTL) accepted."
    )
    max_idempotency_key_chars: int = Field(default=256, ge=1, description="Longest client idempotency key.")
    file_max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="Largest file a tenant may upload (a batch's JSONL input), bytes."
    )
    batch_max_lines: int = Field(default=50_000, ge=1, description="Most lines (tasks) one batch's input may hold.")
    batch_chunk_lines: int = Field(
        default=500, ge=1, le=1000, description="Lines a batch's ingest submits per statement (one SubmitTasks each)."
    )
    batch_lease_seconds: float = Field(
        default=30.0, gt=0,
        description="How long a batch's ingest or finalizer holds it without progress before the next read resumes it.",
    )
    batch_max_window_seconds: float = Field(
        default=7 * 86400.0, gt=0, description="Longest completion window a batch may ask for (its lines' queue TTL)."
    )
    max_callback_url_chars: int = Field(default=2048, ge=16, description="Longest callback URL.")
    callback_resolve_timeout_seconds: float = Field(
        default=2.0, gt=0, description="DNS lookup of a callback host (SSRF guard)."
    )
    input_formats: list[InputFormat] = Field(
        default_factory=lambda: list(INPUT_FORMATS), min_length=1, description="Image formats an input may arrive in."
    )
    input_max_side: int = Field(
        default=8192, ge=16, description="Widest and tallest input image UploadInput stores, pixels."
    )
    input_max_pixels: int = Field(
        default=4096 * 4096, ge=256,
        description="Most pixels an input image may decode to (its sides multiplied), checked from its header before "
        "decoding.",
    )
    input_decode_pixels: int = Field(
        default=4096 * 4096, ge=256,
        description="Pixels a submit process decodes at once over all input images (about 3-12 bytes each); more wait.",
    )
    input_fetch_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Whole fetch of an input image URL: resolving, connecting, reading."
    )
    input_fetch_allow_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts exempt from the SSRF guard when fetching input images, e.g. an internal bucket.",
    )
    input_fetch_ca_file: Path | None = Field(
        default=None, description="CA bundle (PEM) that input image URLs are verified against; default: the system's."
    )
    submit_min_time_left_seconds: float = Field(
        default=0.005, ge=0,
        description="A submit call arriving with less time than this before its deadline gets DEADLINE_EXCEEDED at "
        "once.",
    )
    list_default_page_size: int = Field(default=50, ge=1, description="ListTasks page size when the caller gives none.")
    list_max_page_size: int = Field(default=500, ge=1, description="Largest ListTasks page.")
    submit_shutdown_grace_seconds: float = Field(
        default=10.0, ge=0, description="SIGTERM: time in-flight calls get to finish."
    )
    id_node: int | None = Field(
        default=None, ge=0, le=1023, description="A fixed task id node number instead of a leased one; never share one."
    )


class SchedulerSettings(CommonSettings):
    """The scheduler (services.scheduler: scans, retention, TaskAdmin)."""

    scheduler_metrics_port: int = Field(
        default=9103, ge=0, le=65535, description="/metrics port of the scheduler; 0 disables."
    )
    scan_interval_seconds: float = Field(default=2.0, gt=0, description="Scheduler scan period.")
    scan_batch_size: int = Field(default=100, ge=1, description="Rows one scheduler scan moves per pass.")
    created_timeout_seconds: float = Field(
        default=10.0, gt=0,
        description="CREATED longer than this was never dispatched (its submit process died, or the publish failed): "
        "the scheduler dispatches it.",
    )
    max_republish: int = Field(
        default=2,
        ge=0,
        description="Rounds of a queue timeout with nothing moving that a QUEUED task waits before QUEUE_TIMEOUT.",
    )
    processing_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Processing longer than this, all attempts together (plus one grace), is TIMEOUT.",
    )
    processing_grace_seconds: float = Field(default=60.0, ge=0, description="One extension for a slow but live worker.")
    preempt_window_seconds: float = Field(
        default=300.0,
        ge=0,
        description="A preempted task is not preempted again within this many seconds (no thrashing).",
    )
    worker_forget_seconds: float = Field(
        default=100.0, gt=0, description="Worker rows silent this long are deleted (about 10 leases)."
    )
    dead_letter_window_seconds: float = Field(
        default=86400.0, gt=0, description="How far back the scheduler looks for FAILED tasks missing a dead letter."
    )
    requeue_batch_size: int = Field(
        default=50, ge=1, le=1000, description="RequeueTasks batch size when the caller gives none."
    )
    admin_page_size: int = Field(default=100, ge=1, description="Admin listings' page size when the caller gives none.")
    admin_max_page_size: int = Field(
        default=1000, ge=1, description="Largest admin listing page (and ListStuckTasks limit)."
    )
    usage_max_rows: int = Field(
        default=10000, ge=1, description="Most rows one GetUsage answer holds (it says when more matched)."
    )

    # Retention (the scheduler deletes what expired, scan_batch_size rows of each kind per pass; 0 keeps forever)
    retain_tasks_seconds: float = Field(
        default=30 * 86400.0,
        ge=0,
        description="Finished tasks (with events, webhook logs, dead letters, output) kept this long.",
    )
    retain_events_seconds: float = Field(
        default=7 * 86400.0, ge=0, description="Events and webhook attempt logs of finished tasks kept this long."
    )
    retain_results_seconds: float = Field(
        default=7 * 86400.0, ge=0, description="Stored outputs of finished tasks kept this long (the task row stays)."
    )
    retain_reusable_seconds: float = Field(
        default=86400.0, ge=0, description="Outputs of soft-cancelled runs kept for identical requests this long."
    )
    retain_inputs_seconds: float = Field(
        default=7 * 86400.0, ge=0,
        description="Input images no kept task refers to are deleted this long after their last use (upload or "
        "submission).",
    )

    def processing_timeout_for(self, model_id: str) -> float:
        spec = self.models.get(model_id)
        return (spec.processing_timeout_seconds if spec else None) or self.processing_timeout_seconds


class WorkerSettings(CommonSettings):
    """A worker (services.worker): slots, fetching, runs, retries, draining."""

    worker_metrics_port: int = Field(default=9104, ge=0, le=65535, description="/metrics port of a worker; 0 disables.")
    worker_id: str | None = Field(default=None, description="Default: hostname-pid.")
    worker_admin_target: str | None = Field(
        default=None,
        description="gRPC target of TaskAdmin, which checks each WorkerControl caller's admin key; default: "
        "grpc_host:scheduler_port.",
    )
    worker_authorize_timeout_seconds: float = Field(
        default=5.0, gt=0, description="Deadline of the TaskAdmin check a WorkerControl call waits for."
    )
    worker_advertise_host: str | None = Field(
        default=None,
        description="Host the dashboard reaches this worker's WorkerControl at (a pod's IP); default: grpc_host or the "
        "host name.",
    )
    worker_slots: int = Field(
        default=0,
        ge=0,
        description="Concurrent tasks; 0 = ceil(devices x worker_slots_per_device) (CPU: one device; sleep-only: 1).",
    )
    cluster_cap: bool = Field(
        default=True,
        description="A claim waits while running tasks reach floor(sum of the live workers' capacities); the rest "
        "stays QUEUED.",
    )
    worker_slots_per_device: float = Field(
        default=1.5,
        ge=1,
        description="Tasks per device: one in its device phase (denoising, VAE decode), the others encoding and "
        "storing meanwhile.",
    )
    worker_models: list[str] = Field(default_factory=list, description="Models this worker serves; empty = all.")
    heartbeat_seconds: float = Field(default=2.0, gt=0, description="How often a worker renews its lease.")
    drain_grace_seconds: float = Field(default=30.0, ge=0, description="SIGTERM: time running tasks get to finish.")
    drain_stop_seconds: float = Field(
        default=30.0,
        ge=0,
        description="After the grace: time stopped tasks get to release; any left then are abandoned (leases expire).",
    )
    progress_interval_seconds: float = Field(
        default=5.0, ge=0,
        description="Minimum time between a running task's progress writes to PostgreSQL (each a `progress` event: "
        "history, relay, webhooks); every step reaches WatchTask streams live over NATS without one.",
    )
    progress_flush_seconds: float = Field(
        default=1.0, ge=0,
        description="A worker writes the progress that came due at most once per this long (if shorter than "
        "progress_interval_seconds), in one statement of at most its tasks' share (running x this / the interval), "
        "the longest due first: a fleet's writes and their events go in batches spread over the interval, not in one "
        "burst per interval. Each batch reaches a WatchTasks stream as a burst of events sent one after the other, so "
        "its size sets the stream's latency: the default, half of heartbeat_seconds, puts every other write on a beat "
        "(no statement of its own) and halves the burst of one as long as heartbeat_seconds; shorter: smaller batches, "
        "more statements.",
    )
    live_progress_tick_seconds: float = Field(
        default=0.1, ge=0,
        description="A worker hands its slots' steps to its event loop and publishes them live at most once per this "
        "long (one NATS message per tenant with the newest step of each task that moved); the first step goes at once.",
    )
    output_coalesce_seconds: float = Field(
        default=0.05,
        ge=0,
        description="A running task's text deltas are gathered for this long into one output chunk (one NATS message); "
        "its first delta goes at once.",
    )
    result_inline_max_bytes: int = Field(
        default=1024, ge=0,
        description="An output of at most this many bytes is kept in its task's row (result uri: a base64 data: URI, "
        "written by the terminal commit itself) instead of the result store; 0: every output goes to the store. "
        "Not with the s3 store: its outputs carry a presigned download URL, so they all go to it.",
    )
    result_inline_chars: int = Field(
        default=65536, ge=0,
        description="Chat tasks: Task.text (GetTask; not ListTasks) holds the answer up to this many characters "
        "(GetTaskResult: all).",
    )
    worker_fetch_linger_seconds: float = Field(
        default=1.0,
        gt=0,
        description="How long an idle worker's pull request waits on the server before it is renewed.",
    )
    worker_cap_retry_seconds: float = Field(
        default=0.5, gt=0, description="Redelivery delay of a message refused by its model's concurrency cap."
    )
    retry_backoff_seconds: float = Field(default=2.0, gt=0, description="First retry delay; doubles each retry.")
    retry_backoff_max_seconds: float = Field(default=120.0, gt=0, description="Cap of the retry delay.")
    retry_jitter: float = Field(
        default=0.2, ge=0, lt=1, description="Retry delays are scaled by a random factor in [1-j, 1+j]."
    )

    @model_validator(mode="after")
    def _check_worker(self) -> WorkerSettings:
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError("heartbeat_seconds must be at most half of lease_seconds")
        return self


class NotifierSettings(CommonSettings):
    """The notifier (services.notifier: TaskEvents streams, the event relay, webhooks)."""

    notifier_metrics_port: int = Field(
        default=9102, ge=0, le=65535, description="/metrics port of the notifier; 0 disables."
    )
    webhook_schedule_seconds: list[float] = Field(
        default_factory=lambda: [0.0, 5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0],
        description="Delay before each attempt; after the last one the delivery is FAILED.",
    )
    webhook_timeout_seconds: float = Field(default=10.0, gt=0, description="Timeout of one webhook POST.")
    webhook_max_response_bytes: int = Field(default=4096, ge=0, description="Bytes of a response body read.")
    webhook_concurrency: int = Field(default=32, ge=1, description="Terminal webhook POSTs in flight per notifier.")
    webhook_progress_concurrency: int = Field(
        default=8,
        ge=1,
        description="Progress webhook POSTs in flight per notifier (their own lane: never a result's slot).",
    )
    webhook_output_window_seconds: float = Field(
        default=1.0, gt=0,
        description="An opted-in task's output (callback event OUTPUT) is gathered this long into one task.output "
        "webhook.",
    )
    webhook_output_max_bytes: int = Field(
        default=262144,
        ge=1024,
        description="Output text one task.output webhook carries at most; the rest goes in the next.",
    )
    webhook_concurrency_per_destination: int = Field(
        default=4, ge=1, description="Webhook POSTs in flight to one scheme://host:port, over every notifier replica."
    )
    webhook_breaker_failures: int = Field(
        default=5,
        ge=1,
        description="Consecutive failed attempts (5xx, timeout, no answer) that open a destination's breaker.",
    )
    webhook_breaker_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long an open breaker holds a destination's webhooks before one trial attempt.",
    )
    stream_buffer_size: int = Field(default=1000, ge=1, description="Events buffered per slow subscriber.")
    notifier_gc_young_threshold: int = Field(
        default=10_000, ge=1,
        description="Python's first garbage-collector threshold in the notifier process (Python's default: 700): each "
        "keep-alive tick wakes every quiet stream at once, and at 700 those wake-ups' allocations ran a young "
        "collection every few hundred streams (10-15% of an idle notifier's CPU with 2,000 streams at one keep-alive "
        "each 3 s).",
    )
    notifier_gc_full_threshold: int = Field(
        default=100, ge=1,
        description="Python's third garbage-collector threshold in the notifier process (Python's default: 10): a full "
        "collection walks every open stream's objects (~1.5 s of CPU with 10,000 streams), so it runs about every 30 s "
        "of idle streams instead of every 10 s.",
    )
    event_feed_heartbeat_seconds: float = Field(
        default=5.0,
        gt=0,
        description="The notifier's live event feed: heartbeat period; two missed ones recreate its consumer.",
    )
    relay_batch_size: int = Field(default=500, ge=1, description="Events one relay pass publishes and records.")
    relay_scan_interval_seconds: float = Field(
        default=1.0, gt=0, description="Relay catch-up scan period (NOTIFY wakes it sooner)."
    )
    relay_publish_timeout_seconds: float = Field(
        default=5.0, gt=0, description="Wait for JetStream acks of one relay pass."
    )
    webhook_scan_interval_seconds: float = Field(
        default=1.0, gt=0, description="Safety-net scan period of the webhook outbox."
    )
    webhook_lease_seconds: float = Field(
        default=30.0, gt=0, description="A sender's hold on a delivery (at least 2x the timeout)."
    )
    webhook_jitter: float = Field(default=0.1, ge=0, lt=1, description="Retry delays vary by up to this fraction.")

    @model_validator(mode="after")
    def _check_notifier(self) -> NotifierSettings:
        if not self.webhook_schedule_seconds:
            raise ValueError("webhook_schedule_seconds needs at least one attempt")
        return self


class HttpSettings(CommonSettings):
    """The HTTP/JSON API and dashboard (services.http)."""

    http_port: int = Field(
        default=8000,
        ge=0,
        le=65535,
        description="Port of the HTTP/JSON API and dashboard (services.http); 0 = ephemeral.",
    )
    http_host: str = Field(default="127.0.0.1", description="Address the HTTP service binds ('0.0.0.0' in a cluster).")
    http_metrics_port: int = Field(
        default=9105, ge=0, le=65535, description="/metrics port of the HTTP service; 0 disables."
    )
    http_gateway_target: str | None = Field(
        default=None, description="gRPC target of TaskGateway for the HTTP service; default: grpc_host:submit_port."
    )
    http_events_target: str | None = Field(
        default=None, description="gRPC target of TaskEvents for the HTTP service; default: grpc_host:notifier_port."
    )
    http_admin_target: str | None = Field(
        default=None,
        description="gRPC target of TaskAdmin for the HTTP service (dashboard); default: grpc_host:scheduler_port.",
    )
    http_json_max_depth: int = Field(
        default=32,
        ge=2,
        le=500,
        description="HTTP service: how deep a JSON request body may nest (deeper: 400 on body).",
    )
    http_cors_origins: list[str] = Field(
        default_factory=list,
        description="Origins whose pages may call the HTTP API from a browser (CORS), e.g. https://app.example.com; "
        "empty: none (no CORS headers).",
    )
    http_call_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Deadline of each gRPC call the HTTP service makes."
    )
    http_shutdown_grace_seconds: float = Field(
        default=5.0, ge=0, description="SIGTERM: time open HTTP requests get to finish."
    )
    openai_windows: dict[str, float] = Field(
        default_factory=lambda: {"1h": 3600.0, "24h": 86400.0},
        description="OpenAI face: the completion windows a batch may name, in seconds (its lines' max_queue_seconds).",
    )


class LocalSettings(CommonSettings):
    """The local stack (`make run`: taskgate_local.dev)."""

    dev_start_timeout_seconds: float = Field(
        default=180.0, gt=0, description="make run: time the services get to become healthy."
    )
    dev_demo_timeout_seconds: float = Field(
        default=300.0, gt=0, description="make run: time the demo task gets to finish."
    )
    dev_stop_timeout_seconds: float = Field(
        default=45.0, gt=0, description="make run: time the services get to stop after SIGTERM before they are killed."
    )
    dev_demo_only: bool = Field(
        default=False, description="make run: stop everything and exit after the demo video is saved."
    )


class Settings(GatewaySettings, SchedulerSettings, WorkerSettings, NotifierSettings, HttpSettings, LocalSettings):
    """Every group at once: for tools, tests, the bench and `make run`, which start or inspect every service. A service
    reads its own group only (services.<name> takes its <Name>Settings; tests/unit/test_architecture.py keeps it so)."""


# Each group and the services that read it (docs/configuration.md's sections, in this order).
GROUPS: tuple[tuple[type[CommonSettings], str], ...] = (
    (CommonSettings, "every process"),
    (GatewaySettings, "services.submit (TaskGateway)"),
    (SchedulerSettings, "services.scheduler (scans, retention, TaskAdmin)"),
    (WorkerSettings, "services.worker"),
    (NotifierSettings, "services.notifier (TaskEvents, relay, webhooks)"),
    (HttpSettings, "services.http (HTTP/JSON API, dashboard)"),
    (LocalSettings, "taskgate_local.dev (`make run`)"),
)

S = TypeVar("S", bound=CommonSettings)


@overload
def load_settings(**overrides: object) -> Settings: ...
@overload
def load_settings(group: type[S], /, **overrides: object) -> S: ...
def load_settings(group: type[CommonSettings] = Settings, /, **overrides: object) -> CommonSettings:
    """Reads the environment into `group` (default: every setting); a bad value exits with one line naming the variable
    and why."""
    try:
        return group(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        name = f"TASKGATE_{field.split('.')[0].upper()}" if err["loc"] else "TASKGATE_*"
        sys.stderr.write(f"taskgate: invalid configuration: {name}: {err['msg']}\n")
        raise SystemExit(2) from None
