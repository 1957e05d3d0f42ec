"""The terminal chat app behind `edgeinfer chat` (entry point: app.ChatApp)."""
