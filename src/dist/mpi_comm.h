// The MPI backend of dist/comm.h (internal): MPI_COMM_WORLD as a Comm. Built when CMake finds MPI
// (HLM_HAVE_MPI); otherwise mpi_world() throws.
#pragma once

#include <memory>

#include "dist/comm.h"

namespace hlm::dist {

// Initialises MPI (finalised at exit) and returns its world.
std::unique_ptr<Comm> mpi_world();

}  // namespace hlm::dist
