"""Tools for developing corechat, never imported by the service: a production host installs
service/ alone (deploy/install.sh), and these need requirements-devmodel.txt on top."""
