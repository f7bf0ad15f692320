"""The KV-Direct benchmark's report (filled in below)."""
