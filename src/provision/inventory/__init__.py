"""The inventory as the user wrote it: the YAML parsed and validated (every problem at once,
each naming its FILE:LINE and key), the files it pushes, the checks that need no network,
and the inventories provision writes (a trial's, a promoted one)."""
