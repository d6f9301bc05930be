"""`provision sandbox up|down|reboot|list|image`: local test hosts and an inventory for them."""

from __future__ import annotations

import datetime
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import click

from provision import sandbox as sandboxes
from provision.core.errors import ProvisionError
from provision.sandbox.hosts import Sandbox
from provision.sandbox.inventory import HEADER


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


@click.group()
def sandbox() -> None:
    """Local test hosts: Docker containers with systemd and sshd.

    Needs a Docker engine; the host image is built once from Debian's packages
    (root and debootstrap needed for that first build)."""


@sandbox.command("up")
@click.option(
    "--hosts", "-n", "hosts", default=3, show_default=True, type=click.IntRange(1, 128), help="Number of hosts."
)
@click.option(
    "--gpus-per-host",
    "-g",
    default=0,
    show_default=True,
    type=click.IntRange(0, 16),
    help="Fake NVIDIA H100 GPUs each host's nvidia-smi reports.",
)
@click.option(
    "--with",
    "with_",
    multiple=True,
    type=click.Choice(["tensorflow", "torch", "docker"]),
    help="Framework layer mounted on every host, or `docker` for a Docker engine on every host (repeatable).",
)
@click.option(
    "--name",
    default="sandbox",
    show_default=True,
    help="Sandbox name; hosts are the containers NAME-host-1, NAME-host-2, ...",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Inventory file to write [default: ./NAME.inventory.yaml].",
)
@click.option("--job", default="demo", show_default=True, help="Job name in the inventory.")
@click.option(
    "--from",
    "from_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A job file (an inventory without hosts/ssh, e.g. inventories/sandbox/*.yaml): "
    "the inventory written is that job on the sandbox's hosts.",
)
@click.option(
    "--ssh-port",
    type=click.IntRange(1, 65535),
    help="host-1's SSH port on 127.0.0.1 (the others follow) [default: free ports].",
)
@click.option("--force", is_flag=True, help="Overwrite an inventory file not written by sandbox up.")
@click.option(
    "--timeout",
    default=180,
    show_default=True,
    type=click.IntRange(10, 3600),
    help="Seconds to wait for the hosts to boot.",
)
def up_cmd(
    hosts: int,
    gpus_per_host: int,
    with_: tuple[str, ...],
    name: str,
    output: Path | None,
    job: str,
    from_file: Path | None,
    ssh_port: int | None,
    force: bool,
    timeout: int,
) -> None:
    """Start HOSTS local hosts and write an inventory for them."""

    sandboxes.validate_name(name)
    template = None
    if from_file is not None:
        explicit = click.get_current_context().get_parameter_source("job")
        template = job_from_file(from_file, job if explicit == click.core.ParameterSource.COMMANDLINE else None)
    path = output or Path(f"{name}.inventory.yaml")
    if path.exists() and not force:
        head = path.read_text(errors="replace")[: len(HEADER)]
        if head != HEADER:
            raise ProvisionError(
                f"{path}: exists and was not written by `provision sandbox up`; "
                "pass -o OTHER_PATH, or --force to overwrite it"
            )
    # A plain `kill` (CI timeouts, service managers) must clean up like Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.monotonic()
    try:
        click.echo(
            f"Starting sandbox {name!r}: {hosts} host{'s' if hosts != 1 else ''}"
            + (f", {gpus_per_host} fake GPU(s) each" if gpus_per_host else "")
            + (f", with {', '.join(with_)}" if with_ else ""),
            err=True,
        )
        sb = sandboxes.up(
            name,
            hosts=hosts,
            gpus_per_host=gpus_per_host,
            with_=with_,
            ssh_port=ssh_port,
            timeout=timeout,
            progress=_progress,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    if template is not None:
        sandboxes.write_inventory(sb, path, **template)
    else:
        sandboxes.write_inventory(sb, path, job=job, pools=sandboxes.example_pools(sb))
    _refresh_known_hosts(path, sb)
    _say_up(sb, path.resolve(), time.monotonic() - t0)


def _say_up(sb: Sandbox, inv: Path, took: float) -> None:
    """The sandbox's hosts, its inventory, and what to run next."""
    click.echo(f"Sandbox {sb.name!r} is up ({took:.1f} s):")
    for h in sb.hosts:
        extra = f", {h.gpus} GPU{'s' if h.gpus != 1 else ''}" if h.gpus else ""
        click.echo(f"  {h.name:<8} 127.0.0.1:{h.ssh_port:<6} cluster address {h.cluster_address}{extra}")
    click.echo(f"Inventory: {inv}")
    click.echo("Next:")
    click.echo(f"  provision validate {inv}")
    click.echo(f"  provision apply {inv}")
    click.echo(f"  {' '.join(sb.ssh_command(sb.hosts[0]))}")
    click.echo(f"  provision sandbox down --name {sb.name}")


def _refresh_known_hosts(inventory: Path, sb: Sandbox) -> None:
    """Replace stale keys for this sandbox's addresses in the known_hosts that `apply` keeps
    beside its state (default place, `.provision/known_hosts`).

    Sandbox hosts are reached at 127.0.0.1:<port>, and a later sandbox can get a port an
    earlier one had (after the engine restarts, say): `apply` would then refuse the new
    host's key as a changed key. The sandbox learnt each new host's key as it booted, so it
    is the authority for these exact addresses."""
    path = inventory.parent / ".provision" / "known_hosts"
    if not path.is_file() or not sb.known_hosts_path.is_file():
        return
    ours = sb.known_hosts_path.read_text().splitlines()
    ids = {line.split()[0] for line in ours if line.strip()}
    kept = [
        line for line in path.read_text().splitlines() if not line.strip() or not set(line.split()[0].split(",")) & ids
    ]
    path.write_text("\n".join(kept + ours) + "\n")


def job_from_file(path: Path, job: str | None = None) -> dict[str, Any]:
    """`write_inventory` arguments for the job in PATH (an inventory without hosts/ssh):
    its keys as they are, `files:` sources made absolute (they are relative to PATH)."""
    import yaml  # local for no start-up time: sandbox.inventory has loaded PyYAML already

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ProvisionError(f"{path}: cannot read the job: {e}") from None
    if not isinstance(data, dict) or not data.get("job"):
        raise ProvisionError(f"{path}: expected an inventory with at least `job:` and `pools:`")
    data = {k: v for k, v in data.items() if k not in ("hosts", "ssh")}
    base = Path(path).resolve().parent
    for f in data.get("files") or []:
        if isinstance(f, dict) and isinstance(f.get("src"), str) and not Path(f["src"]).expanduser().is_absolute():
            slash = "/" if f["src"].endswith("/") else ""
            f["src"] = str((base / f["src"]).resolve()) + slash
    data["job"] = job or data["job"]
    return data


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


@sandbox.command("down")
@click.option("--name", default="sandbox", show_default=True, help="Sandbox to remove.")
@click.option("--all", "all_", is_flag=True, help="Remove every sandbox.")
def down_cmd(name: str, all_: bool) -> None:
    """Remove a sandbox's containers, network and SSH key."""
    names = [s.name for s in sandboxes.list_sandboxes()] if all_ else [name]
    if all_ and not names:
        click.echo("No sandboxes.")
        return
    for n in names:
        result = sandboxes.down(n, progress=_progress)
        if result.found:
            click.echo(
                f"Sandbox {n!r} removed ({result.containers} container"
                f"{'s' if result.containers != 1 else ''}, {result.networks} network)."
            )
            for net in result.stale_networks:
                click.echo(
                    f"Note: Docker kept network {net} for endpoints of containers already "
                    "removed (a dockerd bug; restarting dockerd clears it). It is harmless: "
                    "the next sandbox of this name uses another network.",
                    err=True,
                )
        else:
            click.echo(f"No sandbox named {n!r}; nothing to remove.")


@sandbox.command("reboot")
@click.argument("name")
@click.argument("host")
@click.option(
    "--timeout",
    default=120,
    show_default=True,
    type=click.IntRange(5, 3600),
    help="Seconds to wait for the host to answer again.",
)
def reboot_cmd(name: str, host: str, timeout: int) -> None:
    """Restart HOST (host-2, 2, or its container name) of sandbox NAME: a real systemd
    shutdown and boot, same SSH port and host key. Returns once it answers over SSH and
    systemd is running."""
    t0 = time.monotonic()
    h = sandboxes.reboot(name, host, timeout=timeout, progress=_progress)
    click.echo(f"Sandbox {name!r}: {h.name} rebooted, back at 127.0.0.1:{h.ssh_port} ({time.monotonic() - t0:.1f} s).")


@sandbox.command("list")
def list_cmd() -> None:
    """Show the sandboxes on this machine."""
    rows = sandboxes.list_sandboxes()
    if not rows:
        click.echo("No sandboxes. Start one with `provision sandbox up`.")
        return
    click.echo(f"{'NAME':<24} {'HOSTS':>5} {'RUNNING':>7} {'GPUS':>4}  {'WITH':<18} {'CREATED':<19} STATUS")
    for s in rows:
        created = datetime.datetime.fromtimestamp(s.created).strftime("%Y-%m-%d %H:%M:%S") if s.created else "-"
        status = s.status if s.metadata else "leftover (no metadata)"
        if s.metadata and s.running < s.hosts:
            status = f"{status}, {s.hosts - s.running} host(s) not running"
        click.echo(
            f"{s.name:<24} {s.hosts or s.containers:>5} {s.running:>7} "
            f"{s.gpus_per_host:>4}  {','.join(s.frameworks) or '-':<18} {created:<19} {status}"
        )


@sandbox.command("image")
@click.option("--rebuild", is_flag=True, help="Build again even if the image exists.")
def image_cmd(rebuild: bool) -> None:
    """Build the host image now (otherwise the first `up` does)."""
    tag = sandboxes.ensure_image(progress=_progress, rebuild=rebuild)
    click.echo(f"Host image: {tag}")
