"""The benchmark workload as a pyinfra deploy (bench/compare.py runs it).

Every host gets the env file (TF_CONFIG and the rest, exactly the bytes `provision render`
wrote for the job) and the systemd unit, then the unit runs; a change to either file
restarts it. The inventory compare.py writes gives each host `job` and `task`; `rendered`
(the render output directory) comes in with --data.
"""

from pyinfra import host
from pyinfra.operations import files, systemd
from pyinfra.operations.util import any_changed

job = host.data.job
task = host.data.task
base = f"{host.data.rendered}/{host.name}"
unit = f"provision-{job}-{task}.service"
env_path = f"/etc/provision/{job}/{task}.env"
unit_path = f"/etc/systemd/system/{unit}"

files.directory(name="job directory", path=f"/etc/provision/{job}", mode="700")
env_file = files.put(name="env file", src=base + env_path, dest=env_path, mode="600")
unit_file = files.put(name="unit file", src=base + unit_path, dest=unit_path, mode="644")
systemd.daemon_reload(name="daemon-reload", _if=unit_file.did_change)
systemd.service(name="restart task", service=unit, running=True, restarted=True, _if=any_changed(env_file, unit_file))
systemd.service(name="task running", service=unit, running=True)
