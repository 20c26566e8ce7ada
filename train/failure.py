"""A job as a command: a known cause of failure ends the process with one line per failing rank.

Bad input, a refused checkpoint, a timeout or a lost peer (ValueError, TypeError, OSError, gloo's
words for a peer that exited) is a cause the message already names with its fix: a traceback of
every rank would bury it. PIPEZERO_TRACEBACK=1 raises it as it is; anything else always does.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from pipezero.comm import is_peer_lost

__all__ = ["run_as_command"]


def run_as_command(main: Callable[[Any], Any], argv: Any, name: str) -> Any:
    """main(argv); a known cause of failure printed as `name [rank R]: Kind: message` and exit code 1."""
    try:
        return main(argv)
    except (ValueError, TypeError, OSError) as err:
        _brief(err, name)
    except RuntimeError as err:
        if not is_peer_lost(err):
            raise
        _brief(err, name)
    raise AssertionError("unreachable: _brief exits")


def _brief(err: BaseException, name: str) -> None:
    if os.environ.get("PIPEZERO_TRACEBACK") == "1":
        raise err
    rank = os.environ.get("RANK")
    print(f"{name}{f' rank {rank}' if rank is not None else ''}: {type(err).__name__}: {err}",
          file=sys.stderr, flush=True)
    sys.exit(1)
