"""hetero-pd's OpenAI-compatible front door (``hpd gateway``)."""
