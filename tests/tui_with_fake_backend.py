"""Test-only: `python -m tests.tui_with_fake_backend` runs the real `run_tui` (terminal driver, signal
handling, exit code) over FakeBackend, for tests that drive tuichat in a pseudo-terminal. History goes to
TUICHAT_DATA_DIR as usual."""

from __future__ import annotations

import argparse

from tests.fake_backend import FakeBackend
from tuichat.config import Config
from tuichat.store import Store
from tuichat.ui.app import run_tui


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-s", type=float, default=0.005, help="seconds between streamed tokens")
    parser.add_argument("--first-token-s", type=float, default=0.05, help="seconds before a reply's first token")
    parser.add_argument("--reply", help="the one canned reply (default: FakeBackend's)")
    args = parser.parse_args()
    replies = {"replies": [args.reply]} if args.reply else {}
    backend = FakeBackend(first_token_s=args.first_token_s, token_s=args.token_s, **replies)
    run_tui(lambda: backend, Config(), Store(), [])


if __name__ == "__main__":
    main()
