"""The admin API: its routes, their authentication and scope, and the audit of what admins do."""
