"""Generated hetero-pd contracts."""
