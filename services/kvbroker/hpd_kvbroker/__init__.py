"""hetero-pd."""
