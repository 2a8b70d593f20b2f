"""`rlora serve`: check the arguments, load the base model, serve it (uvicorn) until interrupted."""

from __future__ import annotations

import ipaddress
import socket
import warnings
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from rlora.config import ModelConfig
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.models.loading import add_model_eos_ids, causal_lm, load_base_model, load_tokenizer, resolve_model_path
from rlora.serve.app import MAX_BODY, Served, build_app
from rlora.serve.jobs import Jobs
from rlora.serve.prefix_cache import DEFAULT_MB
from rlora.serve.state import StateDir
from rlora.serve.worker import ModelWorker

DEFAULT_MODEL = "smollm2-135m-instruct"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only localhost is known to stay on this machine
        return False


def check_args(host: str, port: int, api_key: str | None, prefix_cache_mb: int | None = None) -> None:
    """Before anything loads: where it binds, with what key, what it keeps."""
    if prefix_cache_mb is not None and prefix_cache_mb < 0:
        raise UserError(f"--prefix-cache-mb {prefix_cache_mb} is negative: give 0 (no prefix cache) or more")
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port (0 .. 65535)")
    if api_key is not None and not api_key.startswith("tml-"):
        raise UserError("--api-key must start with 'tml-': the tinker SDK refuses to send any other key")
    if not is_loopback(host) and api_key is None:
        raise UserError(f"--host {host} would serve other machines: give an --api-key (clients send it as "
                        "TINKER_API_KEY), or bind to 127.0.0.1")


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port another program holds is one line now, not a
    uvicorn traceback after loading, and the port stays this server's meanwhile (--port 0: a free one, printed)."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0]) if host else None
    except ValueError:
        ip = None  # a host name (localhost: IPv4, as clients given 127.0.0.1 expect)
    try:
        if ip is not None and ip.version == 6:  # ::1, fe80::1%eth0 (scope kept), :: (every address, IPv4 too)
            address = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_STREAM)[0][4]
            return socket.create_server(address, family=socket.AF_INET6,
                                        dualstack_ipv6=ip.is_unspecified and socket.has_dualstack_ipv6())
        return socket.create_server((host, port))
    except OSError as err:
        raise UserError(f"cannot listen on {host_url(host, port)}: {err.strerror or err}") from None


def host_url(host: str, port: int) -> str:
    """HOST:PORT as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build(model: str, state_dir: str | Path, api_key: str | None = None, dtype: str = "float32",
          max_body: int = MAX_BODY, prefix_cache_mb: int = DEFAULT_MB, shared_prefixes: bool = True
          ) -> tuple[FastAPI, Served]:
    """The app serving `model` (a folder or an rlora alias), its state under `state_dir`; its sampled rows' keys and
    values kept up to `prefix_cache_mb` MiB for later prompts that begin with them (serve/prefix_cache.py); a
    forward_backward's data that begin alike run as trees unless shared_prefixes is False (serve/shared_prefix.py)."""
    path = str(Path(resolve_model_path(model, "--model", download=False)).resolve())  # the server never downloads
    state = StateDir(state_dir)
    tokenizer, tok = load_tokenizer(path)
    base = load_base_model(ModelConfig(path=path, dtype=dtype), path)
    base.eval()
    add_model_eos_ids(tok, base)
    config = causal_lm(base).config
    max_length = int(getattr(config, "max_position_embeddings", 0) or 2048)
    worker = ModelWorker(base, tokenizer, tok, path, max_length, state, prefix_cache_bytes=prefix_cache_mb * 2**20)
    if not shared_prefixes:
        worker.min_shared_prefix = None
    names = [path] + ([model] if model != path else [])
    served = Served(names=names, arch=config.model_type, worker=worker, jobs=Jobs(), state=state, api_key=api_key,
                    max_body=max_body)
    return build_app(served), served


def serve_main(args) -> int:
    # peft warns, on every adapter with an output-layer LoRA on a model with tied embeddings, that merging it
    # would change the embeddings too; the server never merges (docs/serve.md says what that means for merge)
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
    check_args(args.host, args.port, args.api_key, args.prefix_cache_mb)
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]
    try:
        app, served = build(args.model or DEFAULT_MODEL, args.state_dir, args.api_key, args.dtype,
                            prefix_cache_mb=DEFAULT_MB if args.prefix_cache_mb is None else args.prefix_cache_mb,
                            shared_prefixes=not args.no_shared_prefixes)
    except BaseException:
        sock.close()
        raise
    if served.worker.engine_refusal is not None:
        info(f"rlora serve: the built-in sampler does not run this model ({served.worker.engine_refusal}): sampling "
             "with transformers generate")
    where = host_url(args.host, port)
    info(f"rlora serve: {served.names[0]} on http://{where} (state: {served.state.root}); "
         f"clients: TINKER_BASE_URL=http://{where} "  # the key itself is never printed (logs)
         f"TINKER_API_KEY={'<the --api-key>' if args.api_key else 'tml-local'}")
    # timeout_graceful_shutdown: Ctrl-C does not wait out the clients' long polls
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        served.jobs.stop()
    return 0
