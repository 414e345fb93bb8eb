"""The Textual front end. `tuichat.ui.app.run_tui` starts it; nothing in this package imports torch."""
