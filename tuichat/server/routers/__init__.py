"""The routes of `tuichat serve`, one router per subject: completions (chat and plain text), models, and
monitoring (health and metrics)."""
