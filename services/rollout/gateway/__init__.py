"""The OpenAI-compatible gateway: chat calls served within sessions (`chat`) and how a closed
session's calls become a group's samples (`samples`)."""
