"""provision: a Terraform-style provisioner for distributed ML training on hosts you own."""

__version__ = "0.1.0"
