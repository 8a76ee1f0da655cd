"""Entry point of a child process: ``python -m agentd.child --fd N [--parent-pid P]``.

The control channel is the inherited socket on fd N (never stdout). The child asks the kernel
to signal it when its parent dies and also exits when the channel closes, so it can never
outlive the supervisor.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

import anyio
from anyio.abc import SocketStream

from agentd.child.runtime import EXIT_BAD_SPAWN, EXIT_PROTOCOL_ERROR, serve_channel
from agentd.obs import configure_logging
from agentd.protocol import FrameChannel, ProtocolError

__all__ = ["EXIT_BAD_SPAWN", "EXIT_PROTOCOL_ERROR", "main", "serve"]
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int | None) -> bool:
    """Ask Linux for SIGTERM when the parent exits; False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return parent_pid is None or os.getppid() == parent_pid


async def serve(fd: int) -> int:
    """Handshake on the channel on ``fd``, then run until Shutdown or EOF; return the exit code."""
    return await serve_channel(FrameChannel(await SocketStream.from_socket(fd)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentd.child", description="agentd child process (started by the supervisor)"
    )
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the control channel socket")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer our parent")
    args = parser.parse_args(argv)
    if not _die_with_parent(args.parent_pid):
        return 0
    configure_logging("json", os.environ.get("AGENTD_LOG_LEVEL", "info"), sys.stderr, pid=os.getpid())
    try:
        return anyio.run(serve, args.fd)
    except ProtocolError as exc:
        print(f"agentd.child: protocol error from supervisor: {exc}", file=sys.stderr, flush=True)
        return EXIT_PROTOCOL_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
