"""The authors' kit: check_algorithm() for any algorithm, ours and users', and its replay."""
