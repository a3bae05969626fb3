"""Tests of the Helm chart (helm/pdserve) with the real helm, kubernetes-validate and checkov."""
