"""What a command does, in order: open an inventory once (context), plan, apply, destroy,
check, end a job, logs, queue, exec/ssh. Returns data; printing is cli/'s."""
