"""The service (`provision serve`): leading, handed-over work, the loop that drives it (calls run/)."""
