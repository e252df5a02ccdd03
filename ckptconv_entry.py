"""The `ckptconv` command's entry point. It lies outside the package so that it runs before the
package's imports (numpy and the rest: about 0.3 s).

A Ctrl-C in that time would otherwise end the process with a KeyboardInterrupt traceback and
exit 1. Here it ends the process as the signal's default action does: exit 130, and nothing has been
written yet. The command installs its own handlers when it starts (ckptconv/signals.py).
"""
import signal


def main():
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # (one a parent ignored stays ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from ckptconv.cli import main as command
    return command()
