"""The host side: what runs on, or describes, a host (layout, protocol, agent, probe script)."""
