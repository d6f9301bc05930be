"""What each host gets for the placed job: the variables each task sees (clusterenv.py:
TF_CONFIG, CLUSTER_SPEC, MASTER_ADDR, ...) and every file (files.py: env files and units
from templates/)."""
