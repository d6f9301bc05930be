"""Everything that reads or writes outside the process: SSH (the only network code), the
parallel step runner, probes, images, the local state, the journal reader."""
