//go:build tools

// Package tools names the program this module builds, so that go mod tidy keeps its
// dependencies.
package tools

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
