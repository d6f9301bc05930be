"""The dashboard: pages, the JSON API and /metrics over a Source (docs/dashboard.md)."""
