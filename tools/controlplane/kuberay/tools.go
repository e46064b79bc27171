//go:build tools

// Package tools names the program this module builds, so that go mod tidy keeps its
// dependencies.
package tools

import (
	_ "github.com/ray-project/kuberay/ray-operator"
)
