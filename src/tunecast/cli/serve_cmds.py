"""`tunecast serve`: the web planner on this machine, the page and its JSON API. It runs in the foreground until
stopped (Ctrl-C): the one tunecast process that stays up, and only when asked for; no other command leaves a
process behind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from tunecast.cli.app import state
from tunecast.cli.render import err
from tunecast.errors import TunecastError

if TYPE_CHECKING:
    import socket

LOOPBACK_NAMES = ("localhost",)
CONNECTIONS = 100


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress

    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (port 0: any free one); a user error when it cannot be had."""
    import socket

    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        raise TunecastError(f"cannot listen on --host {host}: {error}", field="--host",
                            hint="give an address of this machine, such as 127.0.0.1 (the default)") from None
    family, kind, proto, _, address = infos[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as error:
        listener.close()
        hint = ("choose another --port, or --port 0 for any free one" if error.errno in (98, 48) else
                "choose a port above 1023, or another --host")
        raise TunecastError(f"cannot listen on {host}:{port}: {error.strerror}", field="--port", hint=hint) from None
    listener.set_inheritable(True)
    return listener


def serve_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option("--host", help="Address to listen on. The default, 127.0.0.1, is this machine "
                                      "only; any other lets others on the network use the planner.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).", min=0, max=65535)]
    = 8000,
    open_browser: Annotated[bool, typer.Option("--open/--no-open", help="Open the page in a browser once the "
                                               "server is up.")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", metavar="SECONDS", min=1.0, help="The longest one "
                                                  "request may run before it is stopped and answered 503. Default: "
                                                  "ten minutes (a cold trace of a large model's settings on a laptop "
                                                  "CPU takes minutes).")] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Never contact the Hugging Face Hub: a model outside the "
                                          "catalog is refused rather than its config.json fetched. HF_HUB_OFFLINE=1 "
                                          "does the same.")] = False,
) -> None:
    """The web planner: pick a model (or drop its config.json), method, lengths, dataset, GPUs and prices, and see
    the ranked runs, memory per GPU, cost against time and rent against buy update as you go. The page talks to a
    JSON API (its spec at /openapi.json) that answers with the documents the commands' --json print. Ctrl-C stops
    it."""
    import uvicorn

    from tunecast.serve.app import REQUEST_SECONDS, create_app

    loopback = is_loopback(host)
    if not loopback:
        err.print(f"[yellow]warning:[/] --host {escape(host)} is not a loopback address: anyone who can reach this "
                  "machine on that network can use the planner, and through it read the files a config names. Use "
                  "the default 127.0.0.1 unless that is what you want.")
    listener = bind(host, port)
    bound = listener.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{shown}:{bound}/"
    allowed = [host.strip("[]").lower(), "localhost", "127.0.0.1", "::1"] if loopback else None
    app = create_app(state(ctx).catalog_dir, allowed_hosts=allowed,
                     timeout_s=timeout if timeout is not None else REQUEST_SECONDS, offline=offline)
    err.print(f"tunecast serve: the planner is at {url} (API spec: {url}openapi.json); Ctrl-C stops it")
    # past CONNECTIONS at once, uvicorn answers 503 at once rather than queue more (a page holds a handful)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                            limit_concurrency=CONNECTIONS)
    server = uvicorn.Server(config)
    if open_browser:
        import threading
        import webbrowser

        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: uvicorn shut it down, passing the signal on
        pass
    finally:
        listener.close()
    err.print("tunecast serve: stopped")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
