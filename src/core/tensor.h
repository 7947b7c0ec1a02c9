// Tensor: a strided view (shape, strides in elements, offset) of shared, typed storage on one
// device. Views share storage; copies are explicit (clone, contiguous, to).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace hlm {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
// Element and byte counts; an overflow (or a negative dimension) is an hlm::Error naming the shape.
int64_t shape_numel(const Shape& s);
size_t shape_nbytes(const Shape& s, DType dt);

struct Storage {
  void* ptr = nullptr;
  size_t nbytes = 0;
  Device device = Device::cpu;
  Storage(Device d, size_t n);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor

  // ---- construction ----
  static Tensor empty(const Shape& shape, DType dt, Device dev = Device::cpu);
  static Tensor zeros(const Shape& shape, DType dt, Device dev = Device::cpu);
  static Tensor full(const Shape& shape, double value, DType dt, Device dev = Device::cpu);
  // A CPU tensor holding `values` converted to dt (values.size() must equal the shape's numel).
  static Tensor from_values(const Shape& shape, const std::vector<double>& values, DType dt);
  template <class T>
  static Tensor from_vector(const Shape& shape, const std::vector<T>& v) {
    HLM_CHECK(int64_t(v.size()) == shape_numel(shape), "from_vector: {} values for shape {}",
              v.size(), shape_str(shape));
    Tensor t = empty(shape, dtype_of<T>::value);
    std::copy(v.begin(), v.end(), t.data<T>());
    return t;
  }
  static Tensor scalar(double v, DType dt) { return from_values({}, {v}, dt); }
  // A contiguous view of existing storage starting `byte_offset` bytes in (a multiple of the
  // element size); used by Arena to carve workspaces out of one allocation.
  static Tensor wrap(std::shared_ptr<Storage> storage, size_t byte_offset, const Shape& shape,
                     DType dt);

  // ---- properties ----
  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu; }
  bool is_cpu() const { return device() == Device::cpu; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return shape_nbytes(shape_, dtype_); }
  size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  bool same_storage(const Tensor& o) const { return storage_ == o.storage_; }
  std::string describe() const;  // "f32[2, 3] cpu"

  // ---- raw access (pointer at this view's first element; device memory for CUDA tensors) ----
  void* raw() const;
  template <class T>
  T* data() const {
    HLM_CHECK(dtype_of<T>::value == dtype_, "tensor holds {}, accessed as {}", dtype_name(dtype_),
              dtype_name(dtype_of<T>::value));
    return static_cast<T*>(raw());
  }

  // ---- views (share storage) ----
  Tensor view(const Shape& shape) const;     // contiguous only; one -1 allowed
  Tensor reshape(const Shape& shape) const;  // view when contiguous, else a contiguous copy
  Tensor slice(int64_t d, int64_t start, int64_t end) const;
  Tensor select(int64_t d, int64_t index) const;  // drops dimension d
  Tensor transpose(int64_t a, int64_t b) const;
  Tensor unsqueeze(int64_t d) const;
  // Dimension d (of size n * inner, any stride) as two, [n, inner]: a view of any strides.
  Tensor split_dim(int64_t d, int64_t inner) const;
  // A view of the same storage with the given shape and (non-negative) strides, starting `offset`
  // elements after this view's first; every element it spans must lie inside the storage.
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset = 0) const;
  // The same bytes read as dt, whose element size must equal this dtype's.
  Tensor bitcast(DType dt) const;

  // ---- copies ----
  Tensor contiguous() const;  // this when already contiguous
  Tensor clone() const;       // always a new contiguous tensor
  Tensor to(DType dt) const;  // new tensor (CPU: any pair; CUDA: same dtype only for now)
  Tensor to(Device dev) const;
  void copy_(const Tensor& src);  // same shape; converts dtype; any device pair (same dtype)
  void fill_(double v);
  void zero_();

  // ---- host-side helpers (CPU tensors, any dtype, any strides) ----
  std::vector<double> to_f64_vector() const;  // in row-major order of the view
  // The values of an i64 or i32 tensor (any device) as int64, in row-major order of the view.
  std::vector<int64_t> to_i64_vector() const;
  double item() const;  // numel must be 1
  double at(std::initializer_list<int64_t> idx) const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
};

// Checks used by ops and layers to validate arguments; they throw hlm::Error naming `what`.
void check_shape(const Tensor& t, const Shape& expected, const char* what);
void check_dim(const Tensor& t, int64_t ndim, const char* what);
void check_dtype(const Tensor& t, DType dt, const char* what);
void check_device(const Tensor& t, Device dev, const char* what);
void check_defined(const Tensor& t, const char* what);

}  // namespace hlm
